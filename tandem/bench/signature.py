"""What always-on mismatch detection costs: 4 KB all_reduce with and without signatures.

Run::

    python -m tandem.bench signature            # 2 ranks, ~1 min

Every collective builds a signature (op, dtype, shape, reduce op, root, algorithm)
and its caller's ``file:line``, sends both in each message header and compares them
on receipt. To measure that, fresh pairs of rank processes run 4 KB all_reduce
either as shipped or with signature and call site replaced by constant one-byte
strings (all else equal); the two kinds of run alternate, and each reports its best
round in wall time and in CPU time per op (CPU time counts every thread of the rank
and is the steadier figure on a shared machine). The table gives the median over
runs. Toggling the two modes inside one process was tried first and gave biased,
unstable figures (from -8% to +49%), hence separate processes. Even so, run-to-run
noise on a shared 2-core machine is about +-20%, larger than the effect; so the
command also times the signature work itself in one process (``timeit``: building
the signature and call site and encoding both, as every call does) and states it as
a share of the measured 4 KB latency. That share is the figure to trust.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Sequence

import torch

from tandem.bench._latency import all_reduce_latency, alternate

__all__ = ["main"]


def _rank(rank: int, world_size: int, numel: int, iters: int, rounds: int,
          plain: bool) -> tuple[float, float]:
    from tandem.collectives import api

    if plain:
        plain_sig = api.Sig("x")
        api._sig = lambda *a, **k: plain_sig
        api.call_site = lambda: "?"
    return all_reduce_latency(numel, iters, rounds)


def signature_work_seconds() -> float:
    """Per-call cost of what signatures add on the calling side, timed in this process."""
    import timeit

    from tandem.collectives import api

    tensor = torch.ones(1024)

    def work() -> None:
        api._sig("all_reduce", tensor, op="SUM", algorithm="doubling").encode()
        api.call_site().encode()

    return min(timeit.repeat(work, number=20000, repeat=5)) / 20000


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench signature",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=5, help="process pairs per mode")
    args = parser.parse_args(argv)
    from tandem.testing import spawn

    figures = alternate(args.runs, lambda plain: spawn(
        2, _rank, (args.bytes // 4, args.iters, args.rounds, plain), timeout=600, op_timeout=120))
    print(f"all_reduce {args.bytes} B, 2 ranks, median of {args.runs} runs per mode "
          f"(each the best of {args.rounds} rounds x {args.iters})")
    for index, unit in ((0, "wall time"), (1, "CPU time")):
        with_s = statistics.median(f[index] for f in figures[False])
        without_s = statistics.median(f[index] for f in figures[True])
        print(f"  {unit:9}: with signatures {with_s * 1e6:7.1f} us, without {without_s * 1e6:7.1f} "
              f"us, overhead {(with_s / without_s - 1) * 100:+.1f}%")
    work = signature_work_seconds()
    latency = statistics.median(f[0] for f in figures[False])
    print(f"  signature work per call (timeit, one process): {work * 1e6:.2f} us = "
          f"{work / latency * 100:.1f}% of the 4 KB latency above")
    return 0
