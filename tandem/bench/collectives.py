"""Collective bus bandwidth: tandem's backends against gloo and the machine's copy bound.

Run::

    python -m tandem.bench collectives                  # all_reduce, 2 and 3 ranks, 4 KB..64 MB
    python -m tandem.bench collectives --ops all_reduce,broadcast,all_gather --markdown
    python -m tandem.bench collectives --backend shm    # one tandem backend (= --backends shm)
    python -m tandem.bench collectives --quick          # 2 ranks, 4 KB and 1 MB, seconds
    python -m tandem.bench collectives --link 1gbit:0.2ms   # across simulated hosts (root):
                                                        # see tandem.bench.collectives_hosts

How it measures. For each world size one set of rank processes joins gloo
(file:// rendezvous) once, then each tandem backend of ``--backends`` (default
tcp, shm, auto) in turn: ``init_process_group`` on a fresh FileStore, every
(op, size), ``destroy_process_group``, the next backend. All over loopback, one
torch thread per rank. shm and auto are skipped, with the reason printed, where
the shared-memory transport is unsupported (auto would only repeat tcp there).

For each (backend, op, size) the tandem backend and gloo first run the op once on
known values and the result is checked, so the table can never time garbage.
Then rounds rotate between three contenders (the tandem backend, gloo, the copy
below) so all see the same machine noise; each round is a barrier followed by
back-to-back float32 ops, with each contender's count chosen so a round takes
about ``--round-ms``. A round's time is the slowest rank's; a contender's figure
is its best round's mean time per op. Small messages on a shared machine are
noisy: the best round is the stable statistic.

Bus bandwidth follows nccl-tests (``doc/PERFORMANCE.md``): algbw = bytes / time and
busbw = algbw * factor, with bytes and factor per op, p = world size:

    all_reduce   bytes = size        factor = 2(p-1)/p
    broadcast    bytes = size        factor = 1
    reduce       bytes = size        factor = 1        (to rank 0)
    all_gather   bytes = size * p    factor = (p-1)/p
    reduce_scatter bytes = size      factor = (p-1)/p   (reduce_scatter_tensor)

``size`` is always the per-rank input buffer (for all_gather nccl-tests labels rows
by the total output, ``size * p``). "<backend> ratio" = that backend's busbw / gloo's
busbw in the rounds interleaved with it: above 1 means tandem is faster. The
"gloo busbw" column is gloo's best over all backends' rounds.

The memory-bandwidth bound. The least memory traffic an op can need is that every
rank touches its buffers once, all ranks at the same time: for all_reduce every
rank reads its input and writes its output once, for broadcast every rank writes
the output once, for reduce every rank reads its input once, for all_gather every rank writes its ``size * p`` output once, for
reduce_scatter every rank reads its ``size`` input once.
That is one copy per rank, so t_copy = the time for every rank to concurrently do
``dst.copy_(src)`` of ``size`` bytes (all_gather: ``size * p``) on float32 tensors
allocated and pre-faulted once per (backend, op, size), timed like the ops
(barrier, slowest rank per round, best round over every backend's rounds).
"bound busbw" = busbw with t_copy in place of the op's time (same bytes and
factor), and "best/bound" = the fastest tandem backend's busbw as a percentage of
it. Below a few KB t_copy is mostly the cost of one ``copy_`` call, and while
every rank's buffers fit in the CPU's caches the copy runs from cache, so only the
large sizes measure main memory. Sizes are binary (1 KB = 1024
bytes); bandwidths are decimal (1 MB/s = 10^6 bytes/s), as in nccl-tests.
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
from typing import Any, Callable, Mapping, Sequence

import torch

__all__ = ["main", "Row", "run", "parse_sizes", "parse_backends", "usable_backends"]

OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter")
BACKENDS = ("tcp", "shm", "auto")
_SHARED_MEMORY = ("shm", "auto")
CONTENDERS = ("tandem", "gloo", "copy")  # rotated through in every (backend, op, size)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30}
_MAX_ITERS = 2000
_OP_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: best per-op seconds of each tandem backend, gloo and the copy."""

    world_size: int
    op: str
    size: int  # bytes of the per-rank input buffer
    rounds: int
    tandem_s: Mapping[str, float]  # backend -> its best round
    gloo_s: Mapping[str, float]  # backend -> gloo's best round among those interleaved with it
    bound_s: float  # the concurrent copy's best round over all backends (module docstring)

    def busbw(self, seconds: float) -> float:
        """Bus bandwidth in bytes/s, nccl-tests convention (see the module docstring)."""
        p = self.world_size
        if self.op == "all_reduce":
            return self.size / seconds * 2 * (p - 1) / p
        if self.op == "all_gather":
            return self.size * p / seconds * (p - 1) / p
        if self.op == "reduce_scatter":
            return self.size / seconds * (p - 1) / p
        return self.size / seconds

    def ratio(self, backend: str) -> float:
        """``backend``'s busbw over gloo's, measured in the same interleaved rounds."""
        return self.busbw(self.tandem_s[backend]) / self.busbw(self.gloo_s[backend])

    @property
    def best_backend(self) -> str:
        return min(self.tandem_s, key=lambda b: self.tandem_s[b])

    @property
    def percent_of_bound(self) -> float:
        """The fastest tandem backend's busbw as a percentage of the bound's."""
        return 100.0 * self.busbw(self.tandem_s[self.best_backend]) / self.busbw(self.bound_s)


# ---- inside each rank process ---------------------------------------------------------


def _check(lib: Any, name: str, op: str, numel: int, rank: int, p: int) -> None:
    """Run ``op`` once on known values and raise if the result is wrong."""
    if op == "barrier":  # nothing to check; it runs once as the warm-up
        lib.barrier()
        return
    if op == "all_reduce":
        t = torch.full((numel,), float(rank + 1))
        lib.all_reduce(t)
        got, want = t, torch.full((numel,), float(p * (p + 1) // 2))
    elif op == "broadcast":
        t = torch.full((numel,), 7.0) if rank == 0 else torch.zeros(numel)
        lib.broadcast(t, src=0)
        got, want = t, torch.full((numel,), 7.0)
    elif op == "reduce":  # only the root's result is defined
        t = torch.full((numel,), float(rank + 1))
        lib.reduce(t, dst=0)
        got = t if rank == 0 else torch.full((numel,), float(p * (p + 1) // 2))
        want = torch.full((numel,), float(p * (p + 1) // 2))
    elif op == "reduce_scatter":
        got = torch.zeros(numel // p)
        lib.reduce_scatter_tensor(got, torch.full((numel,), float(rank + 1)))
        want = torch.full((numel // p,), float(p * (p + 1) // 2))
    elif op == "gather":  # only the root's list is defined; root 0
        outs = [torch.zeros(numel) for _ in range(p)]
        lib.gather(torch.full((numel,), float(rank + 1)), outs if rank == 0 else None, dst=0)
        want = torch.cat([torch.full((numel,), float(r + 1)) for r in range(p)])
        got = torch.cat(outs) if rank == 0 else want
    elif op == "scatter":
        got = torch.zeros(numel)
        lib.scatter(got, [torch.full((numel,), float(r + 1)) for r in range(p)]
                    if rank == 0 else None, src=0)
        want = torch.full((numel,), float(rank + 1))
    elif op == "all_to_all":  # numel: each rank's whole input, numel // p to each rank
        got = torch.zeros(numel // p * p)
        lib.all_to_all_single(got, torch.arange(numel // p * p, dtype=torch.float32) + rank * numel)
        m = numel // p
        want = torch.cat([torch.arange(rank * m, (rank + 1) * m, dtype=torch.float32) + r * numel
                          for r in range(p)])
    else:
        outs = [torch.zeros(numel) for _ in range(p)]
        lib.all_gather(outs, torch.full((numel,), float(rank + 1)))
        got = torch.cat(outs)
        want = torch.cat([torch.full((numel,), float(r + 1)) for r in range(p)])
    if not torch.equal(got, want):
        bad = int((got != want).nonzero()[0])
        raise AssertionError(f"{name} {op} of {numel * 4} bytes on rank {rank}/{p}: element "
                             f"{bad} is {got[bad].item()}, expected {want[bad].item()}")


def _step(lib: Any, op: str, numel: int, p: int) -> Callable[[], object]:
    """One timed operation on preallocated buffers (zeros, so sums never overflow)."""
    if op == "barrier":
        return lambda: lib.barrier()
    t = torch.zeros(numel)
    if op == "all_reduce":
        return lambda: lib.all_reduce(t)
    if op == "broadcast":
        return lambda: lib.broadcast(t, src=0)
    if op == "reduce":
        return lambda: lib.reduce(t, dst=0)
    if op == "reduce_scatter":
        out = torch.zeros(numel // p)
        return lambda: lib.reduce_scatter_tensor(out, t)
    if op == "all_to_all":
        ins, out = torch.zeros(numel // p * p), torch.zeros(numel // p * p)
        return lambda: lib.all_to_all_single(out, ins)
    outs = [torch.zeros(numel) for _ in range(p)]
    if op == "gather":
        rank = lib.get_rank()
        return lambda: lib.gather(t, outs if rank == 0 else None, dst=0)
    if op == "scatter":
        rank = lib.get_rank()
        return lambda: lib.scatter(t, outs if rank == 0 else None, src=0)
    return lambda: lib.all_gather(outs, t)


def _copy_step(numel: int, rank: int) -> Callable[[], object]:
    """``dst.copy_(src)`` on buffers written once here, so no page faults are timed."""
    src = torch.full((numel,), float(rank + 1))
    dst = torch.zeros(numel)
    dst.copy_(src)
    if not torch.equal(dst, src):
        raise AssertionError(f"copy of {numel * 4} bytes on rank {rank} is wrong")
    return lambda: dst.copy_(src)


def _round(barrier: Callable[[], object], step: Callable[[], object], iters: int) -> float:
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - start) / iters


def _measure_one(tandem: Any, gloo: Any, backend: str, op: str, size: int, rank: int, p: int,
                 rounds: int, round_s: float,
                 contenders: Sequence[str] = CONTENDERS) -> dict[str, Any]:
    """Per-op seconds of each of ``contenders``, per round, for one (backend, op, size)."""
    numel = max(1, size // 4)
    if op in ("reduce_scatter", "all_to_all"):  # every rank's output is numel / p elements
        numel = max(p, numel - numel % p)
    _check(tandem, backend, op, numel, rank, p)  # also the warm-up
    _check(gloo, "gloo", op, numel, rank, p)
    timed = {"tandem": (tandem.barrier, _step(tandem, op, numel, p)),
             "gloo": (gloo.barrier, _step(gloo, op, numel, p))}
    if "copy" in contenders:
        timed["copy"] = (gloo.barrier, _copy_step(numel * p if op == "all_gather" else numel,
                                                  rank))
    names = list(contenders)
    # every rank must run the same number of iterations: agree on the slowest
    # estimate through gloo
    probe = max(1, min(20, (1 << 20) // size))
    est = torch.tensor([_round(*timed[n], probe) for n in names], dtype=torch.float64)
    gloo.all_reduce(est, op=gloo.ReduceOp.MAX)
    iters = {n: max(1, min(_MAX_ITERS, int(round_s / max(e, 1e-9))))
             for n, e in zip(names, est.tolist())}
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(_round(*timed[name], iters[name]))
    return {"backend": backend, "op": op, "size": size, "times": times}


def _rank_main(rank: int, p: int, tmp: str, backends: Sequence[str], ops: Sequence[str],
               sizes: Sequence[int], rounds: int, round_s: float,
               contenders: Sequence[str] = CONTENDERS) -> list[dict[str, Any]]:
    """Body of one rank: per (backend, op, size), this rank's per-op seconds per round."""
    torch.set_num_threads(1)
    import torch.distributed as gloo

    import tandem

    gloo.init_process_group("gloo", init_method=f"file://{tmp}/gloo", rank=rank, world_size=p,
                            timeout=datetime.timedelta(seconds=_OP_TIMEOUT_S))
    results: list[dict[str, Any]] = []
    try:
        for backend in backends:
            tandem.init_process_group(backend, init_method=f"file://{tmp}/tandem-{backend}",
                                      rank=rank, world_size=p, timeout=_OP_TIMEOUT_S)
            try:
                for op in ops:
                    for size in sizes:
                        results.append(_measure_one(tandem, gloo, backend, op, size, rank, p,
                                                    rounds, round_s, contenders))
            finally:
                tandem.destroy_process_group()
    finally:
        gloo.destroy_process_group()
    return results


# ---- in the parent --------------------------------------------------------------------


def _measure(p: int, backends: Sequence[str], ops: Sequence[str], sizes: Sequence[int],
             rounds: int, round_s: float, timeout: float) -> list[Row]:
    from tandem.testing import spawn

    env = {}
    if any(name == "lo" for _, name in socket.if_nameindex()):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo would otherwise pick the hostname's interface
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        per_rank = spawn(p, _rank_main, (tmp, backends, ops, sizes, rounds, round_s),
                         init=False, timeout=timeout, env=env)
    return rows_from(per_rank, ops, sizes, rounds)


def rows_from(per_rank: Sequence[Sequence[Mapping[str, Any]]], ops: Sequence[str],
              sizes: Sequence[int], rounds: int,
              bound: Callable[[str, int], float] | None = None) -> list[Row]:
    """One :class:`Row` per (op, size) from every rank's :func:`_rank_main` result.

    ``bound(op, size)`` gives the bound in seconds; without it, the copy contender's
    best round is the bound.
    """
    def best(i: int, name: str) -> float:
        # a round lasts as long as its slowest rank; keep the best round
        return min(max(rank[i]["times"][name][r] for rank in per_rank) for r in range(rounds))

    rows = []
    for op in ops:
        for size in sizes:
            where = {e["backend"]: i for i, e in enumerate(per_rank[0])
                     if (e["op"], e["size"]) == (op, size)}
            rows.append(Row(len(per_rank), op, size, rounds,
                            tandem_s={b: best(i, "tandem") for b, i in where.items()},
                            gloo_s={b: best(i, "gloo") for b, i in where.items()},
                            bound_s=bound(op, size) if bound is not None else
                            min(best(i, "copy") for i in where.values())))
    return rows


def run(world_sizes: Sequence[int], ops: Sequence[str], sizes: Sequence[int], *,
        backends: Sequence[str] = BACKENDS, rounds: int = 7, round_s: float = 0.07,
        timeout: float = 600.0) -> list[Row]:
    """Measure every (world size, op, size); one set of rank processes per world size.

    ``backends`` must run here: filter them with :func:`usable_backends` first.
    """
    rows: list[Row] = []
    for p in world_sizes:
        rows.extend(_measure(p, backends, ops, sizes, rounds, round_s, timeout))
    return rows


def usable_backends(backends: Sequence[str]) -> tuple[list[str], str]:
    """The backends this machine can run, and why any were dropped ("" if none was)."""
    from tandem.transport.shm import unsupported_reason

    why = unsupported_reason()
    dropped = [b for b in backends if why and b in _SHARED_MEMORY]
    if not dropped:
        return list(backends), ""
    return ([b for b in backends if b not in dropped],
            f"skipped {', '.join(dropped)}: shared memory is unsupported here ({why})")


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


def pick(parser: argparse.ArgumentParser, flag: str, text: str, choices: Sequence[str],
         empty_ok: bool = False) -> list[str]:
    """The names in ``text``, flag ``flag``'s comma list, each one of ``choices`` (and at
    least one unless ``empty_ok``); else the parser's usage error naming what is wrong."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(names) - set(choices))
    if unknown or not (names or empty_ok):
        parser.error(f"{flag}: {f'unknown {unknown}' if unknown else 'none given'}; "
                     f"choose from {', '.join(choices)}")
    return names


def parse_backends(text: str) -> list[str]:
    """``"tcp,shm"`` -> ``["tcp", "shm"]``: known tandem backends, each once, in order."""
    names = list(dict.fromkeys(b.strip().lower() for b in text.split(",") if b.strip()))
    unknown = [b for b in names if b not in BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"bad backend list {text!r}; choose from {', '.join(BACKENDS)}")
    return names


def _one_backend(text: str) -> list[str]:
    names = parse_backends(text)
    if len(names) != 1:
        raise argparse.ArgumentTypeError(f"--backend takes one name, got {text!r}; "
                                         f"use --backends for a list")
    return names


def _fmt_size(n: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _fmt_bw(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e6:.1f} MB/s"


def _header(backends: Sequence[str]) -> list[str]:
    per_backend = [f"{b} {col}" for b in backends for col in ("busbw", "ratio")]
    return ["ranks", "op", "size", "gloo busbw", *per_backend, "bound busbw", "best/bound"]


def _cells(row: Row, backends: Sequence[str]) -> list[str]:
    per_backend = [cell for b in backends
                   for cell in (_fmt_bw(row.busbw(row.tandem_s[b])), f"{row.ratio(b):.2f}")]
    return [str(row.world_size), row.op, _fmt_size(row.size),
            _fmt_bw(row.busbw(min(row.gloo_s.values()))), *per_backend,
            _fmt_bw(row.busbw(row.bound_s)),
            f"{row.percent_of_bound:.3g}% ({row.best_backend})"]


def format_table(rows: Sequence[Row], markdown: bool = False) -> str:
    """Fixed-width text table, or a markdown one for the README."""
    backends = list(rows[0].tandem_s) if rows else []
    header = _header(backends)
    body = [_cells(r, backends) for r in rows]
    numeric = [True, False] + [True] * (len(header) - 2)  # op is the only text column
    if markdown:
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join("---:" if n else ":---" for n in numeric) + "|"]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in body])
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    just = [str.rjust if n else str.ljust for n in numeric]
    return "\n".join("  ".join(j(c, w) for j, c, w in zip(just, cells, widths))
                     for cells in [header, *body])


def _parser() -> argparse.ArgumentParser:
    from tandem.bench.collectives_hosts import DEFAULT_LAYOUTS

    parser = argparse.ArgumentParser(prog="python -m tandem.bench collectives",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--world-sizes", default="2,3", help="comma list (default 2,3)")
    parser.add_argument("--sizes", type=parse_sizes, default=None,
                        help="per-rank bytes, comma list, K/M = 1024/1024^2 "
                             "(default 4K,64K,1M,16M,64M; across hosts 4K,1M,16M,64M)")
    parser.add_argument("--ops", default=None,
                        help=f"comma list of {', '.join(OPS)} (default all_reduce; across "
                             f"hosts all_reduce,all_gather,reduce_scatter)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--backends", type=parse_backends, default=None, metavar="LIST",
                       help=f"tandem backends, comma list (default {','.join(BACKENDS)}; "
                            f"across hosts auto)")
    which.add_argument("--backend", type=_one_backend, dest="backends", metavar="NAME",
                       help="one tandem backend: the same as --backends NAME")
    parser.add_argument("--rounds", type=int, default=7,
                        help="rounds per contender and backend (default 7)")
    parser.add_argument("--round-ms", type=float, default=70.0,
                        help="length of one round; 3 x rounds of them per backend and size "
                             "(default 70)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="deadline per world size or layout, seconds (default 600; "
                             "across hosts 1800)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 ranks (across hosts: 2x1), 4 KB and 1 MB, "
                             "2 short rounds")
    hosts = parser.add_argument_group(
        "across simulated hosts (root; see tandem.bench.collectives_hosts)")
    hosts.add_argument("--link", type=_link, default=None, metavar="RATE[:DELAY[:LOSS]]",
                       help="shape every host's link, e.g. 1gbit:0.2ms, 10gbit:1ms:0.1%%, "
                            "unshaped")
    hosts.add_argument("--hosts", type=int, default=None, help="simulated hosts (>= 2)")
    hosts.add_argument("--ranks-per-host", type=int, default=None,
                       help="ranks on each host (default 1)")
    hosts.add_argument("--layouts", default=None, metavar="LIST",
                       help=f"HOSTSxRANKS comma list instead of --hosts/--ranks-per-host "
                            f"(default {DEFAULT_LAYOUTS})")
    return parser


def _link(text: str) -> Any:
    from tandem.testing.links import LinkShape

    try:
        return LinkShape.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc



def _main_hosts(parser: argparse.ArgumentParser, args: argparse.Namespace,
                ops: list[str]) -> int:
    from tandem.bench._hosts import Unavailable, parse_layouts
    from tandem.bench.collectives_hosts import (DEFAULT_LAYOUTS, DEFAULT_OPS, DEFAULT_SIZES,
                                                format_hosts_table, run_hosts)
    from tandem.testing.links import LinkShape

    if args.layouts and (args.hosts or args.ranks_per_host):
        parser.error("use either --layouts or --hosts/--ranks-per-host")
    text = args.layouts or (f"{args.hosts}x{args.ranks_per_host or 1}" if args.hosts
                            else DEFAULT_LAYOUTS)
    try:
        layouts = parse_layouts(text)
    except ValueError as exc:
        parser.error(str(exc))
    backends = args.backends or ["auto"]
    if "shm" in backends:
        parser.error("backend 'shm' cannot reach other hosts; use auto or tcp")
    ops = ops or list(DEFAULT_OPS)
    sizes = args.sizes or parse_sizes(DEFAULT_SIZES)
    rounds, round_s = args.rounds, args.round_ms / 1e3
    if args.quick:
        layouts, sizes, rounds, round_s = layouts[:1], [4 << 10, 1 << 20], 2, 0.02
    link = args.link or LinkShape()
    print(f"machine: {machine()}", flush=True)
    start = time.monotonic()
    try:
        rows = run_hosts(layouts, link, backends, ops, sizes, rounds, round_s,
                         args.timeout or 1800.0)
    except Unavailable as exc:
        print(f"simulated hosts are unavailable here: {exc}")
        return 1
    print(f"tandem {', '.join(backends)} vs torch.distributed 'gloo' across simulated hosts, "
          f"every host link {link}; float32, 1 thread/rank; best of {rounds} rounds of "
          f"~{round_s * 1e3:.0f} ms; time per op; ratio = gloo time / tandem time (>1: tandem "
          f"faster); x/bound = link bound / x's time; {time.monotonic() - start:.0f} s")
    print(format_hosts_table(rows, markdown=args.markdown))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    ops = pick(parser, "--ops", args.ops or "", OPS, empty_ok=True)
    if args.rounds < 1 or args.round_ms <= 0:
        parser.error("need --rounds >= 1 and --round-ms > 0")
    if args.link is not None or args.hosts or args.layouts or args.ranks_per_host:
        return _main_hosts(parser, args, ops)
    ops = ops or ["all_reduce"]
    try:
        world_sizes = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    except ValueError:
        parser.error(f"--world-sizes must be integers, got {args.world_sizes!r}")
    if not world_sizes or min(world_sizes) < 2:
        parser.error("need world sizes >= 2")
    sizes = args.sizes or parse_sizes("4K,64K,1M,16M,64M")
    rounds, round_s = args.rounds, args.round_ms / 1e3
    if args.quick:
        world_sizes, sizes, rounds, round_s = [2], [4 << 10, 1 << 20], 2, 0.02
    backends, skipped = usable_backends(args.backends or list(BACKENDS))
    print(f"machine: {machine()}")
    if skipped:
        print(skipped)
    if not backends:
        return 1
    start = time.monotonic()
    rows = run(world_sizes, ops, sizes, backends=backends, rounds=rounds, round_s=round_s,
               timeout=args.timeout or 600.0)
    print(f"tandem {', '.join(backends)} vs torch.distributed 'gloo', loopback, float32, "
          f"1 thread/rank; best of {rounds} rounds of ~{round_s * 1e3:.0f} ms; busbw per "
          f"nccl-tests; ratio = backend/gloo busbw (>1: tandem faster); bound = every rank "
          f"copying its buffer at once; {time.monotonic() - start:.0f} s")
    print(format_table(rows, markdown=args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
