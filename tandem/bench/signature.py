"""What always-on mismatch detection costs: 4 KB all_reduce with and without signatures.

Run::

    python -m tandem.bench signature            # 2 ranks, ~10 s

Every collective builds a signature (op, dtype, shape, reduce op, root, algorithm)
and its caller's ``file:line``, sends both in each message header and compares them
on receipt. To measure that, the same rank processes alternate rounds of 4 KB
all_reduce as shipped and rounds where signature and call site are replaced by a
constant one-byte string (all else equal), and report the best round of each, in
wall time and in CPU time per op (the steadier figure on a shared machine).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

import torch

__all__ = ["main"]


def _round(tensor: torch.Tensor, iters: int) -> tuple[float, float]:
    """(wall, CPU) seconds per op; CPU time counts every thread of this rank."""
    import tandem

    tandem.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(iters):
        tandem.all_reduce(tensor)
    return (time.perf_counter() - start) / iters, (time.process_time() - cpu) / iters


def _rank(rank: int, world_size: int, numel: int, iters: int, rounds: int) -> dict[str, float]:
    from tandem.collectives import api

    real_sig, real_site = api._sig, api.call_site
    tensor = torch.ones(numel)
    best = {"with": float("inf"), "without": float("inf"), "with_cpu": float("inf"),
            "without_cpu": float("inf")}
    for r in range(rounds):
        for mode in (("with", "without") if r % 2 == 0 else ("without", "with")):
            if mode == "without":
                api._sig = lambda *a, **k: "x"
                api.call_site = lambda: "?"
            try:
                wall, cpu = _round(tensor, iters)
                best[mode] = min(best[mode], wall)
                best[f"{mode}_cpu"] = min(best[f"{mode}_cpu"], cpu)
            finally:
                api._sig, api.call_site = real_sig, real_site
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench signature",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    from tandem.testing import spawn

    results: list[Any] = spawn(2, _rank, (args.bytes // 4, args.iters, args.rounds),
                               timeout=600, op_timeout=120)
    print(f"all_reduce {args.bytes} B, 2 ranks, best of {args.rounds} rounds x {args.iters}")
    for unit, suffix in (("wall time", ""), ("CPU time", "_cpu")):
        with_s = max(r["with" + suffix] for r in results)
        without_s = max(r["without" + suffix] for r in results)
        print(f"  {unit:9}: with signatures {with_s * 1e6:7.1f} us, without {without_s * 1e6:7.1f} "
              f"us, overhead {(with_s / without_s - 1) * 100:+.1f}%")
    return 0
