"""Helpers of ``examples/train_chars.py``: corpus, model, trainer, plot, progress, checkpoint.

Run the example, not this package::

    python examples/train_chars.py --quick
"""
