"""Collective latency and bus bandwidth: tandem (``--backend``, default "tcp") against gloo.

Run::

    python -m tandem.bench collectives                  # all_reduce, 2 and 3 ranks: ~20 s on 2 cores
    python -m tandem.bench collectives --ops all_reduce,broadcast,all_gather --markdown  # ~1.5 min
    python -m tandem.bench collectives --quick          # 2 ranks, 4 KB and 1 MB, seconds

How it measures. For each world size one set of rank processes joins BOTH tandem
(backend "tcp", FileStore rendezvous) and gloo (file:// rendezvous), all over
loopback, one torch thread per rank. For each (op, size) both libraries first run
the op once on known values and the result is checked, so the table can never
time garbage. Then rounds alternate between the libraries (tandem, gloo, gloo,
tandem, ...) so both see the same machine noise; each round is a barrier followed
by ``iters`` back-to-back float32 ops, with ``iters`` chosen so a round takes about
``--round-ms``. A round's time is the slowest rank's; the table shows the best
round's mean time per op. Small messages on a shared machine are noisy: the best
round is the stable statistic.

Bus bandwidth follows nccl-tests (``doc/PERFORMANCE.md``): algbw = bytes / time and
busbw = algbw * factor, with bytes and factor per op, p = world size:

    all_reduce   bytes = size        factor = 2(p-1)/p
    broadcast    bytes = size        factor = 1
    all_gather   bytes = size * p    factor = (p-1)/p

``size`` is always the per-rank input buffer (for all_gather nccl-tests labels rows
by the total output, ``size * p``). ratio = tandem busbw / gloo busbw: above 1 means
tandem is faster. Sizes are binary (1 KB = 1024 bytes); bandwidths are decimal
(1 MB/s = 10^6 bytes/s), as in nccl-tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import socket
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import torch

__all__ = ["main", "Row", "run", "parse_sizes"]

OPS = ("all_reduce", "broadcast", "all_gather")
LIBS = ("tandem", "gloo")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30}
_MAX_ITERS = 2000
_OP_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: best per-op seconds for each library."""

    world_size: int
    op: str
    size: int  # bytes of the per-rank input buffer
    iters: int
    rounds: int
    tandem_s: float
    gloo_s: float

    def busbw(self, seconds: float) -> float:
        """Bus bandwidth in bytes/s, nccl-tests convention (see the module docstring)."""
        p = self.world_size
        if self.op == "all_reduce":
            return self.size / seconds * 2 * (p - 1) / p
        if self.op == "all_gather":
            return self.size * p / seconds * (p - 1) / p
        return self.size / seconds

    @property
    def ratio(self) -> float:
        return self.busbw(self.tandem_s) / self.busbw(self.gloo_s)


# ---- inside each rank process ---------------------------------------------------------


def _check(lib: Any, name: str, op: str, numel: int, rank: int, p: int) -> None:
    """Run ``op`` once on known values and raise if the result is wrong."""
    if op == "all_reduce":
        t = torch.full((numel,), float(rank + 1))
        lib.all_reduce(t)
        got, want = t, torch.full((numel,), float(p * (p + 1) // 2))
    elif op == "broadcast":
        t = torch.full((numel,), 7.0) if rank == 0 else torch.zeros(numel)
        lib.broadcast(t, src=0)
        got, want = t, torch.full((numel,), 7.0)
    else:
        outs = [torch.zeros(numel) for _ in range(p)]
        lib.all_gather(outs, torch.full((numel,), float(rank + 1)))
        got = torch.cat(outs)
        want = torch.cat([torch.full((numel,), float(r + 1)) for r in range(p)])
    if not torch.equal(got, want):
        bad = int((got != want).nonzero()[0])
        raise AssertionError(f"{name} {op} of {numel * 4} bytes on rank {rank}/{p}: element "
                             f"{bad} is {got[bad].item()}, expected {want[bad].item()}")


def _step(lib: Any, op: str, numel: int, p: int) -> Callable[[], None]:
    """One timed operation on preallocated buffers (zeros, so sums never overflow)."""
    t = torch.zeros(numel)
    if op == "all_reduce":
        return lambda: lib.all_reduce(t)
    if op == "broadcast":
        return lambda: lib.broadcast(t, src=0)
    outs = [torch.zeros(numel) for _ in range(p)]
    return lambda: lib.all_gather(outs, t)


def _round(lib: Any, step: Callable[[], None], iters: int) -> float:
    lib.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - start) / iters


def _rank_main(rank: int, p: int, tandem_url: str, gloo_url: str, ops: Sequence[str],
               sizes: Sequence[int], rounds: int, round_s: float,
               backend: str = "tcp") -> list[dict[str, Any]]:
    """Body of one rank: returns, per (op, size), this rank's per-op seconds per round."""
    torch.set_num_threads(1)
    import torch.distributed as tdist

    import tandem

    tandem.init_process_group(backend, init_method=tandem_url, rank=rank, world_size=p,
                              timeout=_OP_TIMEOUT_S)
    tdist.init_process_group("gloo", init_method=gloo_url, rank=rank, world_size=p,
                             timeout=datetime.timedelta(seconds=_OP_TIMEOUT_S))
    libs = {"tandem": tandem, "gloo": tdist}
    results: list[dict[str, Any]] = []
    try:
        for op in ops:
            for size in sizes:
                numel = max(1, size // 4)
                steps = {}
                for name, lib in libs.items():
                    _check(lib, name, op, numel, rank, p)  # also the warm-up
                    steps[name] = _step(lib, op, numel, p)
                # every rank must run the same number of iterations: agree on the
                # slowest estimate through gloo
                probe = max(1, min(20, (1 << 20) // size))
                est = torch.tensor([max(_round(libs[n], steps[n], probe) for n in LIBS)],
                                   dtype=torch.float64)
                tdist.all_reduce(est, op=tdist.ReduceOp.MAX)
                iters = max(1, min(_MAX_ITERS, int(round_s / max(est.item(), 1e-9))))
                times: dict[str, list[float]] = {n: [] for n in LIBS}
                for r in range(rounds):
                    for name in (LIBS if r % 2 == 0 else LIBS[::-1]):
                        times[name].append(_round(libs[name], steps[name], iters))
                results.append({"op": op, "size": size, "iters": iters, "times": times})
    finally:
        tdist.destroy_process_group()
        tandem.destroy_process_group()
    return results


# ---- in the parent --------------------------------------------------------------------


def _measure(p: int, ops: Sequence[str], sizes: Sequence[int], rounds: int,
             round_s: float, timeout: float, backend: str) -> list[Row]:
    from tandem.testing import spawn

    env = {}
    if any(name == "lo" for _, name in socket.if_nameindex()):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo would otherwise pick the hostname's interface
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        per_rank = spawn(p, _rank_main, (f"file://{tmp}/tandem", f"file://{tmp}/gloo", ops,
                                         sizes, rounds, round_s, backend),
                         init=False, timeout=timeout, env=env)
    rows = []
    for i, first in enumerate(per_rank[0]):
        best = {}
        for name in LIBS:
            # a round lasts as long as its slowest rank; keep the best round
            best[name] = min(max(rank[i]["times"][name][r] for rank in per_rank)
                             for r in range(rounds))
        rows.append(Row(p, first["op"], first["size"], first["iters"], rounds,
                        best["tandem"], best["gloo"]))
    return rows


def run(world_sizes: Sequence[int], ops: Sequence[str], sizes: Sequence[int], *,
        rounds: int = 7, round_s: float = 0.07, timeout: float = 600.0,
        backend: str = "tcp") -> list[Row]:
    """Measure every (world size, op, size); one set of rank processes per world size."""
    rows: list[Row] = []
    for p in world_sizes:
        rows.extend(_measure(p, ops, sizes, rounds, round_s, timeout, backend))
    return rows


def machine() -> str:
    """One line naming the machine the numbers came from."""
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f
                          if ln.startswith("model name")), model)
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{model or platform.machine()}, {os.cpu_count()} CPUs ({usable} usable), "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def parse_sizes(text: str) -> list[int]:
    """``"4K,64KB,1M"`` -> bytes (K = 1024); each a positive multiple of 4 (float32)."""
    sizes = []
    for part in filter(None, (s.strip().upper() for s in text.split(","))):
        digits = part.rstrip("KMGB")
        unit = part[len(digits):]
        if not digits.isdigit() or unit not in _UNITS:
            raise argparse.ArgumentTypeError(f"bad size {part!r}; use e.g. 4K, 64KB, 1M")
        size = int(digits) * _UNITS[unit]
        if size <= 0 or size % 4:
            raise argparse.ArgumentTypeError(f"size {part!r} must be a positive multiple of 4")
        sizes.append(size)
    return sizes


def _fmt_size(n: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


_HEADER = ("ranks", "op", "size", "tandem lat", "gloo lat", "tandem busbw", "gloo busbw",
           "ratio")


def _cells(row: Row) -> list[str]:
    return [str(row.world_size), row.op, _fmt_size(row.size), _fmt_time(row.tandem_s),
            _fmt_time(row.gloo_s), f"{row.busbw(row.tandem_s) / 1e6:.1f} MB/s",
            f"{row.busbw(row.gloo_s) / 1e6:.1f} MB/s", f"{row.ratio:.2f}"]


def format_table(rows: Sequence[Row], markdown: bool = False) -> str:
    """Fixed-width text table, or a markdown one for the README."""
    body = [_cells(r) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(_HEADER) + " |",
                 "|" + "|".join(["---:"] * 1 + [":---"] + ["---:"] * 6) + "|"]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in body])
    widths = [max(len(x) for x in col) for col in zip(_HEADER, *body)]
    just = [str.rjust, str.ljust] + [str.rjust] * 6
    return "\n".join("  ".join(j(c, w) for j, c, w in zip(just, cells, widths))
                     for cells in [list(_HEADER), *body])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench collectives",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--world-sizes", default="2,3", help="comma list (default 2,3)")
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("4K,64K,1M,16M,64M"),
                        help="per-rank bytes, comma list, K/M = 1024/1024^2 "
                             "(default 4K,64K,1M,16M,64M)")
    parser.add_argument("--ops", default="all_reduce",
                        help=f"comma list of {', '.join(OPS)} (default all_reduce)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per library (default 7)")
    parser.add_argument("--round-ms", type=float, default=70.0,
                        help="length of one round; 2 x rounds of them per size (default 70)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="deadline per world size, seconds (default 600)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--backend", default="tcp",
                        help="tandem backend: tcp (default), shm, auto")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 ranks, 4 KB and 1 MB, 2 short rounds")
    args = parser.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        parser.error(f"unknown op(s) {unknown}; choose from {list(OPS)}")
    try:
        world_sizes = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    except ValueError:
        parser.error(f"--world-sizes must be integers, got {args.world_sizes!r}")
    if not world_sizes or min(world_sizes) < 2 or args.rounds < 1 or args.round_ms <= 0:
        parser.error("need world sizes >= 2, --rounds >= 1 and --round-ms > 0")
    sizes, rounds, round_s = args.sizes, args.rounds, args.round_ms / 1e3
    if args.quick:
        world_sizes, sizes, rounds, round_s = [2], [4 << 10, 1 << 20], 2, 0.02
    start = time.monotonic()
    rows = run(world_sizes, ops, sizes, rounds=rounds, round_s=round_s, timeout=args.timeout,
               backend=args.backend)
    print(f"machine: {machine()}")
    print(f"tandem '{args.backend}' vs torch.distributed 'gloo', loopback, float32, 1 thread/rank; "
          f"best of {rounds} rounds of ~{round_s * 1e3:.0f} ms; busbw per nccl-tests; "
          f"ratio = tandem/gloo busbw (>1: tandem faster); {time.monotonic() - start:.0f} s")
    print(format_table(rows, markdown=args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
