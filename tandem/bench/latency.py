"""Small-message latency of every collective: the time per blocking call, back to back.

Run::

    python -m tandem.bench latency                        # 4 KB, 2 ranks, tcp and shm
    python -m tandem.bench latency --ops scatter,all_to_all --backends tcp --runs 5

Each run is one fresh set of rank processes per backend; in it, each op runs ``--iters``
calls per round after a warm-up, every round starting at a barrier, and a round's time
is the slowest rank's. A run's figure per op is its best round's mean per call; the
figure printed is the median over ``--runs`` runs (the backends alternate, so both see
the same machine noise). ``all_reduce_custom`` is an all_reduce with a custom
(non-pure) reduce op, whose results are compared across ranks.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Sequence

import torch

__all__ = ["main", "OPS"]

OPS = ("all_reduce", "all_reduce_custom", "broadcast", "reduce", "all_gather",
       "all_gather_into_tensor", "gather", "scatter", "reduce_scatter_tensor", "all_to_all",
       "all_to_all_single", "barrier")


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def _calls(numel: int) -> dict[str, Callable[[], Any]]:
    import tandem

    p, r = tandem.get_world_size(), tandem.get_rank()
    x, big = torch.ones(numel), torch.ones(numel * p)
    parts = [torch.ones(numel) for _ in range(p)]
    outs = [torch.empty(numel) for _ in range(p)]
    custom = tandem.ReduceOp.custom(_add)
    return {
        "all_reduce": lambda: tandem.all_reduce(x),
        "all_reduce_custom": lambda: tandem.all_reduce(x, op=custom),
        "broadcast": lambda: tandem.broadcast(x, src=0),
        "reduce": lambda: tandem.reduce(x, dst=0),
        "all_gather": lambda: tandem.all_gather(outs, x),
        "all_gather_into_tensor": lambda: tandem.all_gather_into_tensor(big, x),
        "gather": lambda: tandem.gather(x, outs if r == 0 else None, dst=0),
        "scatter": lambda: tandem.scatter(x, parts if r == 0 else None, src=0),
        "reduce_scatter_tensor": lambda: tandem.reduce_scatter_tensor(x, big),
        "all_to_all": lambda: tandem.all_to_all(outs, parts),
        "all_to_all_single": lambda: tandem.all_to_all_single(big.clone(), big),
        "barrier": lambda: tandem.barrier(),
    }


def _rank(rank: int, world_size: int, ops: list[str], numel: int, iters: int,
          rounds: int) -> dict[str, float]:
    import tandem

    torch.set_num_threads(1)
    calls = _calls(numel)
    best: dict[str, float] = {}
    for name in ops:
        call = calls[name]
        # no rank starts an op while another is still in the previous one: a gather's or
        # scatter's non-roots return without waiting for their root
        tandem.barrier()
        for _ in range(max(1, iters // 4)):  # warm-up
            call()
        best[name] = float("inf")
        for _ in range(rounds):
            tandem.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                call()
            best[name] = min(best[name], (time.perf_counter() - start) / iters)
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench latency",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    parser.add_argument("--backends", default="tcp,shm", help="comma list (default tcp,shm)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--bytes", type=int, default=4096, help="per rank (default 4096)")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3, help="rank sets per backend")
    args = parser.parse_args(argv)
    from tandem.bench.collectives import pick
    from tandem.testing import spawn

    ops = pick(parser, "--ops", args.ops, OPS)

    backends = [b for b in args.backends.split(",") if b]
    figures: dict[str, list[dict[str, float]]] = {b: [] for b in backends}
    for run in range(args.runs):
        for backend in backends[run % len(backends):] + backends[:run % len(backends)]:
            ranks = spawn(args.world_size, _rank,
                          (ops, args.bytes // 4, args.iters, args.rounds),
                          backend=backend, timeout=900, op_timeout=120)
            figures[backend].append({name: max(r[name] for r in ranks) for name in ops})
    print(f"{args.bytes} B per rank, {args.world_size} ranks, us per call: median of "
          f"{args.runs} runs, each the best of {args.rounds} rounds x {args.iters}")
    print(f"{'op':24}" + "".join(f"{b:>10}" for b in backends))
    for name in ops:
        row = [statistics.median(f[name] for f in figures[b]) * 1e6 for b in backends]
        print(f"{name:24}" + "".join(f"{v:10.1f}" for v in row))
    return 0
