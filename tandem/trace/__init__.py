"""Reading what a job left behind: flight-recorder dumps and timelines.

::

    python -m tandem.trace DIR                       # where did the ranks diverge?
    python -m tandem.trace --timeline out/trace.json # merge out/trace.rank*.json

Both read files only (no torch import), so they run anywhere, also on a laptop
after copying the files. The ranks write them: see ``tandem.collectives.dump``
and ``tandem.collectives.timeline``.
"""
