"""Unmodified torch code over the "tandem" backend against the same code over gloo.

Run::

    python -m tandem.bench torch-backend               # 2 ranks: all_reduce, DDP, FSDP2 (~3 min)
    python -m tandem.bench torch-backend --sizes 4K,64M --parts all_reduce
    python -m tandem.bench torch-backend --markdown    # the table for the README
    python -m tandem.bench torch-backend --quick       # seconds; what the smoke test runs
    python -m tandem.bench torch-backend --parts fsdp,fsdp-short   # FSDP2, two batch sizes

How it measures. One set of rank processes joins torch.distributed with the backend
"tandem" (the default group) and builds a gloo group over the same ranks; every
contender runs torch's own code on one of the two groups, so the library under
torch's API is the only difference. The parts: single calls
(:mod:`tandem.bench.torch_backend_calls`: ``all_reduce`` per size, ``coalesced``) and
training steps (:mod:`tandem.bench.torch_backend_steps`: ``ddp``, ``fsdp``, and
``fsdp-short`` when asked for).

Rounds rotate through the contenders, each round after a barrier, so all see the
same machine noise (:mod:`tandem.bench.torch_backend_rounds`); a round lasts as long
as its slowest rank and a contender's figure is its best round. "speed-up" = gloo's
wall time / tandem's (above 1: tandem is faster; 4 KB latency 0.3x = speed-up 3.3).
"torch layer" is tandem via torch / tandem direct - 1, in wall time and in CPU time per
call (each rank process's, every thread; the best round of the slowest rank): when
more processes want the CPUs than there are, wall time also measures who got
scheduled, CPU time only the work done.

For the FSDP2 step a line below the table gives each backend's time in collectives
(in the best round, the step's wall time less the slowest rank's time outside
collectives) and the ceiling: gloo's step over tandem's step without its collectives,
the speed-up if tandem's collectives took no time at all.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import sys
import tempfile
import time
from typing import Any, Sequence

import torch

from tandem.bench._table import render
from tandem.bench.collectives import machine, parse_sizes, pick
from tandem.bench.torch_backend_calls import all_reduce_part, coalesced_part, layer_cost_seconds
from tandem.bench.torch_backend_rounds import CLOCKS
from tandem.bench.torch_backend_steps import TinyTransformer, steps_part

__all__ = ["main", "run", "format_table", "collectives_line", "TinyTransformer"]

PARTS = ("all_reduce", "coalesced", "ddp", "fsdp", "fsdp-short")
DEFAULT_PARTS = PARTS[:4]
_TIMEOUT_S = 300.0


def _rank_main(rank: int, world: int, tmp: str, parts: Sequence[str], sizes: Sequence[int],
               rounds: int, round_s: float, warmup: int, steps: int,
               small: bool) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    import torch.distributed as dist

    import tandem.torch_backend  # noqa: F401 - registers "tandem"

    dist.init_process_group("tandem", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=_TIMEOUT_S))
    try:
        gloo = dist.new_group(backend="gloo")
        rows: list[dict[str, Any]] = []
        if "all_reduce" in parts:
            rows += all_reduce_part(gloo, rank, world, sizes, rounds, round_s)
        if "coalesced" in parts:
            rows += coalesced_part(gloo, rank, world, rounds, round_s)
        for part in ("ddp", "fsdp", "fsdp-short"):
            if part in parts:
                rows += steps_part(part, gloo, rank, world, warmup, steps, rounds, small)
        return rows
    finally:
        dist.destroy_process_group()


# ---- in the parent --------------------------------------------------------------------


def run(world: int, parts: Sequence[str], sizes: Sequence[int], *, rounds: int = 7,
        round_s: float = 0.07, warmup: int = 2, steps: int = 5, small: bool = False,
        timeout: float = 900.0) -> list[dict[str, Any]]:
    """One row per (part, size or model): each contender's best seconds per op or step.

    ``small`` swaps the models for tiny ones (the CNN of the ddp benchmark, a one-layer
    transformer): a smoke run of the code, not a measurement.
    """
    from tandem.testing import spawn

    env = {"GLOO_SOCKET_IFNAME": "lo"} if any(
        name == "lo" for _, name in socket.if_nameindex()) else {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-torch-") as tmp:
        per_rank = spawn(world, _rank_main,
                         (tmp, parts, sizes, rounds, round_s, warmup, steps, small),
                         init=False, timeout=timeout, env=env)
    rows = []
    for i, row in enumerate(per_rank[0]):
        # per clock: a round counts as its slowest rank; keep the best round
        best = {c: {n: min(max(r[i]["times"][c][n][k] for r in per_rank) for k in range(rounds))
                    for n in row["times"][c]} for c in CLOCKS}
        out = {"part": row["part"], "what": row["what"], "world": world, **best}
        if "collectives" in row["times"]:
            out["outside"] = _outside_collectives([r[i]["times"] for r in per_rank], rounds)
        rows.append(out)
    return rows


def _outside_collectives(per_rank: Sequence[dict[str, dict[str, list[float]]]],
                         rounds: int) -> dict[str, float]:
    """Per contender, in its best round (by the slowest rank's wall time), the longest
    time a rank spent outside collectives: the step's length if they took no time."""
    out = {}
    for name in per_rank[0]["wall"]:
        k = min(range(rounds), key=lambda j: max(t["wall"][name][j] for t in per_rank))
        out[name] = max(t["wall"][name][k] - t["collectives"][name][k] for t in per_rank)
    return out


def _measure(row: dict[str, Any]) -> str:
    part = row["part"]
    return part if part in ("all_reduce", "coalesced") else f"{part.split('-')[0]} step"


def _time(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


_HEADER = ("ranks", "measure", "size / model", "gloo", "tandem", "speed-up", "tandem direct",
           "torch layer")


def _cells(row: dict[str, Any]) -> list[str]:
    wall, cpu = row["wall"], row["cpu"]
    direct = wall.get("tandem direct")
    layer = "-"
    if direct:
        layer = (f"{(wall['tandem'] / direct - 1) * 100:+.1f}% "
                 f"(CPU {(cpu['tandem'] / cpu['tandem direct'] - 1) * 100:+.1f}%)")
    measure = _measure(row)
    return [str(row["world"]), measure, row["what"], _time(wall["gloo"]), _time(wall["tandem"]),
            f"{wall['gloo'] / wall['tandem']:.2f}", _time(direct) if direct else "-", layer]


def collectives_line(row: dict[str, Any]) -> str:
    """For a row timed with its collectives: each backend's time in them and the ceiling."""
    wall, outside = row["wall"], row["outside"]
    shares = ", ".join(
        f"{n} {_time(wall[n] - outside[n])} of {_time(wall[n])} "
        f"({(1 - outside[n] / wall[n]) * 100:.0f}%)" for n in ("gloo", "tandem"))
    return (f"{_measure(row)} ({row['what']}), time in collectives: {shares}; with tandem's "
            f"collectives taking no time the step would take {_time(outside['tandem'])}, a "
            f"ceiling of {wall['gloo'] / outside['tandem']:.2f}x gloo (speed-up now "
            f"{wall['gloo'] / wall['tandem']:.2f}x)")


def format_table(rows: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    body = [_cells(r) for r in rows]
    text = [False, False, False] + [True] * (len(_HEADER) - 3)
    return render(_HEADER, body, text, markdown)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench torch-backend",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                        help=f"comma list of {', '.join(PARTS)} (default: "
                             f"{','.join(DEFAULT_PARTS)})")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("4K,64K,1M,16M,64M"),
                        help="all_reduce bytes per rank, comma list (default 4K,64K,1M,16M,64M)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per contender (default 7)")
    parser.add_argument("--round-ms", type=float, default=70.0,
                        help="length of an all_reduce round (default 70)")
    parser.add_argument("--steps", type=int, default=5,
                        help="training steps per round (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (default 2)")
    parser.add_argument("--timeout", type=float, default=900.0, help="deadline, seconds")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 4 KB, tiny models, 2 short rounds, 1 step per round")
    args = parser.parse_args(argv)
    parts = pick(parser, "--parts", args.parts, PARTS)
    if args.world_size < 2 or min(args.rounds, args.steps) < 1 or args.warmup < 0:
        parser.error("need --world-size >= 2, --rounds/--steps >= 1, --warmup >= 0")
    sizes, rounds, round_s = args.sizes, args.rounds, args.round_ms / 1e3
    warmup, steps = args.warmup, args.steps
    if args.quick:
        sizes, rounds, round_s, warmup, steps = [4 << 10], 2, 0.02, 1, 1
    start = time.monotonic()
    rows = run(args.world_size, parts, sizes, rounds=rounds, round_s=round_s, warmup=warmup,
               steps=steps, small=args.quick, timeout=args.timeout)
    print(f"machine: {machine()}")
    print(f"torch.distributed with backend 'tandem' vs 'gloo', {args.world_size} ranks on one "
          f"host, 1 thread/rank; best of {rounds} rounds; speed-up = gloo/tandem wall time; "
          f"torch layer = tandem via torch / tandem direct - 1 in wall (and CPU) time; "
          f"{time.monotonic() - start:.0f} s")
    print(format_table(rows, markdown=args.markdown))
    direct = next((r["cpu"]["tandem direct"] for r in rows
                   if r["part"] == "all_reduce" and r["what"] == "4 KB"), None)
    if direct is not None:
        cost = layer_cost_seconds(repeat=10 if args.quick else 150)
        print(f"torch layer per call (CPU time, one process, best of alternating repeats): "
              f"{cost * 1e6:.1f} us = {cost / direct * 100:.1f}% of the CPU time of a 4 KB "
              f"tandem direct all_reduce above")
    for row in rows:
        if "outside" in row:
            print(collectives_line(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
