"""RPC: tandem against torch's RPC (TensorPipe), side by side in one run, 2 processes.

Run from the repository root with the project's interpreter::

    python -m tandem.bench rpc                      # auto (shared memory) and tcp: ~1 min
    python -m tandem.bench rpc --transports tcp --rounds 9 --markdown
    python -m tandem.bench rpc --quick              # smoke run: tiny sizes, 2 rounds

Measures, for each transport (``auto``: tandem picks shared memory on one host and
TensorPipe its defaults, shared memory and CMA; ``tcp``: everything over TCP, for
TensorPipe ``_transports=["uv"]`` and ``_channels=["basic"]``):

* ``echo``: ``rpc_sync`` round trip of a small argument (a 16-float tensor), per call;
* ``throughput``: ``--calls`` ``rpc_async`` calls put in flight at once, then waited
  for: calls per second;
* ``64 KB``, ``1 MB``, ``16 MB``: ``rpc_sync`` echo of a float32 tensor of that size, per
  round trip (64 KB is the largest message that goes through the ring in one piece, 1 MB
  the smallest tensor that goes by reference or in lent shared memory).

How: both processes join both libraries (FileStore rendezvous, no ports), worker 0
calls and worker 1 serves. Each round measures every case on both libraries, the
order alternating between rounds, so both see the same machine noise; the table shows
the median of the rounds and the ratio of the medians (tandem / torch: below 1 is
faster for times, above 1 is faster for throughput), with the range of per-round
ratios. Targets: echo <= 0.3x, throughput >= 2x, 64 KB and 1 MB <= 1x, 16 MB <= 0.5x on
shared memory, and no slower than torch over tcp.

``--per-round`` also prints every round's figures with the minor page faults per call of
caller and callee (``getrusage``, asked for by one call on each side of the timed part).
A ratio that moves between rounds may move with either library. Measured on a 2-CPU VM,
where memory touched for the first time costs ~6.7 ms per 16 MB against ~0.7 ms to
rewrite it: torch's 16 MB echoes whose caller faulted ~4,100 pages (16 MB of 4 KB pages)
took 20-33 ms, the others 8-19 ms (30 echoes, load ~6); in one run at load ~40, torch
faulted 2,045-3,278 pages per call as caller and 397-2,633 as callee in every round, and
tandem none on either side (its large receives reuse mappings, ``tandem.rpc._buffers``;
over shared memory they are now views of shared segments the sender lends and reuses).

Both libraries live in both processes, and torch's agent keeps one busy-polling thread per
process even while idle (TensorPipe's shared-memory reactor: 178-180 of 200 scheduler
ticks in 2 s), so tandem's turns share the 2 CPUs with them. Measured by demoting those
threads to ``SCHED_IDLE`` during alternate blocks of tandem's calls (load ~5): tandem's echo
162 us against 231 us beside them, its 16 MB echo 6.48 ms against 6.64 ms.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from typing import Any, Sequence

import torch

__all__ = ["main", "run", "format_table"]

LIBS = ("tandem", "torch")
CASES = ("echo", "throughput", "64 KB", "1 MB", "16 MB")
# the echoed tensor's bytes of the size cases, and how many round trips one round times
_ECHOES = {"64 KB": ("mid", 64 << 10, "mid_trips"), "1 MB": ("mid", 1 << 20, "mid_trips"),
           "16 MB": ("big", 16 << 20, "big_trips")}
TARGETS = {("auto", "echo"): "<= 0.30", ("auto", "throughput"): ">= 2.00",
           ("auto", "64 KB"): "<= 1.00", ("auto", "1 MB"): "<= 1.00",
           ("auto", "16 MB"): "<= 0.50", ("tcp", "echo"): "<= 1.00",
           ("tcp", "throughput"): ">= 1.00", ("tcp", "64 KB"): "<= 1.00",
           ("tcp", "1 MB"): "<= 1.00", ("tcp", "16 MB"): "<= 1.00"}
_TORCH_TRANSPORTS = {"auto": None, "tcp": ["uv"]}
# TensorPipe moves tensor bytes on "channels" of their own: on one host its default picks
# CMA (one copy between the processes' memories) even with the uv transport, so "tcp"
# also asks for the channel that sends them through the transport's TCP connection
_TORCH_CHANNELS = {"auto": None, "tcp": ["basic"]}
_TANDEM_TRANSPORTS = {"auto": None, "tcp": ["uv"]}


def _echo(x: Any) -> Any:
    return x


# ---- inside each process ----------------------------------------------------------------


def _join(tmp: str, transport: str, rank: int) -> dict[str, Any]:
    import torch.distributed.rpc as torch_rpc

    import tandem.rpc as tandem_rpc

    tandem_rpc.init_rpc(f"w{rank}", rank=rank, world_size=2,
                        rpc_backend_options=tandem_rpc.TensorPipeRpcBackendOptions(
                            init_method=f"file://{tmp}/tandem-{transport}", rpc_timeout=300,
                            _transports=_TANDEM_TRANSPORTS[transport]))
    torch_rpc.init_rpc(f"w{rank}", rank=rank, world_size=2,
                       rpc_backend_options=torch_rpc.TensorPipeRpcBackendOptions(
                           init_method=f"file://{tmp}/torch-{transport}", rpc_timeout=300,
                           _transports=_TORCH_TRANSPORTS[transport],
                           _channels=_TORCH_CHANNELS[transport]))
    return {"tandem": tandem_rpc, "torch": torch_rpc}


def _faults() -> int:
    """Minor page faults of this process so far (pages touched for the first time)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _case(lib: Any, case: str, sizes: dict[str, int]) -> tuple[float, float, float]:
    """Seconds per call (echo and the size cases) or calls per second (throughput), and the minor page
    faults per call of the caller and of the callee while the calls ran (asked for by one
    more call on each side of the timed part)."""
    callee = lib.rpc_sync("w1", _faults)
    if case == "echo":
        x, n = torch.ones(16), sizes["echo"]
        caller, start = _faults(), time.perf_counter()
        for _ in range(n):
            lib.rpc_sync("w1", _echo, args=(x,))
        value = (time.perf_counter() - start) / n
    elif case == "throughput":
        n = sizes["calls"]
        caller, start = _faults(), time.perf_counter()
        futures = [lib.rpc_async("w1", _echo, args=(1,)) for _ in range(n)]
        torch.futures.wait_all(futures)
        value = n / (time.perf_counter() - start)
    else:
        kind, nbytes, trips = _ECHOES[case]
        # (--quick shrinks every size case to its smallest: the mid size)
        x, n = torch.ones(min(nbytes, sizes[kind]) // 4), sizes[trips]
        caller, start = _faults(), time.perf_counter()
        for _ in range(n):
            lib.rpc_sync("w1", _echo, args=(x,))
        value = (time.perf_counter() - start) / n
    caller = _faults() - caller
    return value, caller / n, (lib.rpc_sync("w1", _faults) - callee) / n


def _process(rank: int, world: int, tmp: str, transport: str, rounds: int,
             sizes: dict[str, int]) -> dict[str, dict[str, list[tuple[float, float, float]]]]:
    """Per case and library, each round's (figure, caller's and callee's page faults
    per call)."""
    torch.set_num_threads(1)
    libs = _join(tmp, transport, rank)
    results: dict[str, dict[str, list[tuple[float, float, float]]]] = {
        c: {lib: [] for lib in LIBS} for c in CASES}
    try:
        if rank == 0:
            for lib in LIBS:  # warm up: connections, imports, allocator
                for case in CASES:
                    _case(libs[lib], case, {**sizes, "echo": 50, "calls": 200, "mid_trips": 2,
                                                      "big_trips": 1})
            for r in range(rounds):
                order = LIBS if r % 2 == 0 else LIBS[::-1]
                for case in CASES:
                    for lib in order:
                        results[case][lib].append(_case(libs[lib], case, sizes))
    finally:
        for lib in LIBS:
            libs[lib].shutdown()
    return results


# ---- in the parent ------------------------------------------------------------------------


def run(transports: Sequence[str], rounds: int, sizes: dict[str, int],
        timeout: float = 900.0) -> list[dict[str, Any]]:
    """One row per (transport, case): median per library, ratio, per-round ratio range,
    and each round's (tandem, torch) figures and page faults per call."""
    from tandem.testing import spawn

    rows = []
    for transport in transports:
        with tempfile.TemporaryDirectory(prefix="tandem-bench-rpc-") as tmp:
            results = spawn(2, _process, (tmp, transport, rounds, sizes), init=False,
                            timeout=timeout)[0]
        for case in CASES:
            mine = [r[0] for r in results[case]["tandem"]]
            theirs = [r[0] for r in results[case]["torch"]]
            per_round = [a / b for a, b in zip(mine, theirs)]
            rows.append({"transport": transport, "case": case,
                         "tandem": statistics.median(mine), "torch": statistics.median(theirs),
                         "ratio": statistics.median(mine) / statistics.median(theirs),
                         "low": min(per_round), "high": max(per_round),
                         "rounds": list(zip(results[case]["tandem"], results[case]["torch"]))})
    return rows


def _value(case: str, v: float) -> str:
    return f"{v:,.0f} calls/s" if case == "throughput" else (
        f"{v * 1e6:.0f} us" if v < 2e-3 else f"{v * 1e3:.2f} ms")


def format_table(rows: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    header = ["transport", "case", "tandem", "torch", "ratio", "per-round range", "target"]
    body = [[r["transport"], r["case"], _value(r["case"], r["tandem"]),
             _value(r["case"], r["torch"]), f"{r['ratio']:.2f}",
             f"{r['low']:.2f}-{r['high']:.2f}", TARGETS.get((r["transport"], r["case"]), "")]
            for r in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|:---|:---|---:|---:|---:|---:|---:|"]
        return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in body])
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(cells, widths)))
                     for cells in [header, *body])


def format_rounds(rows: Sequence[dict[str, Any]]) -> str:
    """Every round of every row: both figures, the ratio, and each library's minor page
    faults per call (caller + callee)."""
    lines = []
    for r in rows:
        for i, (mine, theirs) in enumerate(r["rounds"], 1):
            lines.append(f"{r['transport']} {r['case']} round {i}: tandem "
                         f"{_value(r['case'], mine[0])} ({mine[1]:.0f}+{mine[2]:.0f} faults/call)"
                         f", torch {_value(r['case'], theirs[0])} ({theirs[1]:.0f}+"
                         f"{theirs[2]:.0f} faults/call), ratio {mine[0] / theirs[0]:.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from tandem.bench.collectives import machine

    parser = argparse.ArgumentParser(prog="python -m tandem.bench rpc",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--transports", default="auto,tcp",
                        help="comma list of auto, tcp (default auto,tcp)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per library (default 5)")
    parser.add_argument("--calls", type=int, default=20_000,
                        help="rpc_async calls in flight for throughput (default 20000)")
    parser.add_argument("--echo-calls", type=int, default=1000,
                        help="rpc_sync calls per echo round (default 1000)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--per-round", action="store_true",
                        help="also print every round's figures and page faults per call")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 rounds, 200 calls, 64 KB for every size")
    args = parser.parse_args(argv)
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if not transports or set(transports) - set(_TORCH_TRANSPORTS):
        parser.error(f"--transports must name some of {sorted(_TORCH_TRANSPORTS)}")
    if args.rounds < 1 or args.calls < 1 or args.echo_calls < 1:
        parser.error("--rounds, --calls and --echo-calls must be >= 1")
    sizes = {"echo": args.echo_calls, "calls": args.calls, "mid": 1 << 20, "mid_trips": 100,
             "big": 16 << 20, "big_trips": 10}
    rounds = args.rounds
    if args.quick:
        sizes, rounds = {"echo": 100, "calls": 200, "mid": 64 << 10, "mid_trips": 3,
                         "big": 64 << 10, "big_trips": 3}, 2
    print(f"machine: {machine()}")
    start = time.monotonic()
    rows = run(transports, rounds, sizes)
    print(f"tandem.rpc vs torch.distributed.rpc (TensorPipe), 2 processes, 1 torch thread "
          f"each; median of {rounds} alternating rounds; ratio = tandem / torch "
          f"(times: < 1 is faster; throughput: > 1 is faster); {time.monotonic() - start:.0f} s")
    print(format_table(rows, markdown=args.markdown))
    if args.per_round:
        print(format_rounds(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
