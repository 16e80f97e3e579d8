"""Benchmarks: tandem and its torch equivalent side by side, in one run, with ratios.

Run from the repository root with the project's interpreter::

    python -m tandem.bench collectives                  # all_reduce, 2 and 3 ranks, 4 KB..64 MB
    python -m tandem.bench collectives --ops all_reduce,broadcast,all_gather
    python -m tandem.bench collectives --world-sizes 2 --sizes 4K,1M --rounds 3
    python -m tandem.bench collectives --markdown       # the table for the README
    python -m tandem.bench collectives --quick          # seconds; what the smoke test runs

Benchmarks are not timed tests: nothing here asserts speed. Each subcommand is a
module with ``main(argv) -> int``, listed in :data:`tandem.bench.__main__.COMMANDS`.
"""
