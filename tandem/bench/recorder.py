"""What the flight recorder costs: 4 KB all_reduce with recording on and off.

Run::

    python -m tandem.bench recorder             # 2 ranks, backend auto, ~1 min
    python -m tandem.bench recorder --backend tcp

Every call on a group is recorded (``tandem.collectives.recorder``): one small object,
one store into the group's ring, three clock reads, the per-op totals, and a check
whether ``torch.profiler`` is recording. The budget is 2% of a 4 KB all_reduce. To
measure it, fresh pairs of rank processes run 4 KB all_reduce either as shipped (the
recorder and the stall watchdog on) or with ``TANDEM_FLIGHT_RECORDER=0`` and
``TANDEM_STALL_WARN=0`` (no recording, no watchdog threads); the two kinds of run
alternate, and each reports its best round in wall time and CPU time per call. The
table gives the median over runs and the spread. As with ``signature``, run-to-run
noise on a shared machine is larger than the effect, so the command also times the
recording work itself in one process (``timeit``: what one call records) and states
it as a share of the measured latency, and times the whole call path (every hook
included) on a one-rank group with recording on and off, where no communication adds
noise: those shares are the figures to trust.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Sequence

import torch

from tandem.bench._latency import all_reduce_latency, alternate

__all__ = ["main", "recording_seconds"]

OFF = {"TANDEM_FLIGHT_RECORDER": "0", "TANDEM_STALL_WARN": "0"}
PATH_REPEATS = 5


def _rank(rank: int, world_size: int, numel: int, iters: int, rounds: int) -> tuple[float, float]:
    return all_reduce_latency(numel, iters, rounds)


def recording_seconds(numel: int = 1024) -> float:
    """Per-call cost of recording one blocking collective, timed in this process."""
    import timeit

    from tandem.collectives.recorder import Recorder

    recorder = Recorder(2000, "default")
    result = [torch.ones(numel)]
    sig, site = b"all_reduce float32[1024] op=SUM algorithm=shm", b"train.py:42"
    seq = iter(range(10 ** 9))

    def record() -> None:
        call = recorder.begin("all_reduce", next(seq), sig, site, result)
        recorder.start(call, 0.0)
        recorder.end(call)

    # CPU time of this process: other processes on a shared machine do not inflate it
    return min(timeit.repeat(record, number=20000, repeat=7, timer=time.process_time)) / 20000


def call_path_seconds(numel: int = 1024, number: int = 3000, repeat: int = 7
                      ) -> tuple[float, float]:
    """CPU seconds per ``all_reduce`` call through the whole API on a one-rank group, with
    recording on and off, in this process (batches alternate): every hook included, no
    communication to add noise."""
    from tandem.collectives import api
    from tandem.collectives.group import ProcessGroup
    from tandem.config import Settings
    from tandem.transport.loopback import LoopbackHub

    groups = {on: ProcessGroup(LoopbackHub(1).transports[0], [0], 0, "bench", 60.0,
                               Settings(flight_recorder=2000 if on else 0), "loopback")
              for on in (True, False)}
    tensor = torch.ones(numel)
    best = {True: float("inf"), False: float("inf")}
    for _ in range(repeat):
        for on, g in groups.items():
            start = time.process_time()
            for _ in range(number):
                api.all_reduce(tensor, group=g)
            best[on] = min(best[on], (time.process_time() - start) / number)
    return best[True], best[False]


def _spread(values: list[float]) -> str:
    return f"{min(values) * 1e6:.2f} to {max(values) * 1e6:.2f} us"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench recorder",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=5, help="process pairs per mode")
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args(argv)
    from tandem.testing import spawn

    figures = alternate(args.runs, lambda off: spawn(
        2, _rank, (args.bytes // 4, args.iters, args.rounds), backend=args.backend, timeout=600,
        op_timeout=120, env=OFF if off else {}))
    print(f"all_reduce {args.bytes} B, 2 ranks, backend {args.backend}, median of {args.runs} "
          f"runs per mode (each the best of {args.rounds} rounds x {args.iters})")
    for index, unit in ((0, "wall time"), (1, "CPU time")):
        on = [f[index] for f in figures[False]]
        off = [f[index] for f in figures[True]]
        with_s, without_s = statistics.median(on), statistics.median(off)
        print(f"  {unit:9}: recording {with_s * 1e6:7.1f} us ({_spread(on)}), off "
              f"{without_s * 1e6:7.1f} us ({_spread(off)}), overhead "
              f"{(with_s / without_s - 1) * 100:+.1f}%")
    work = recording_seconds(args.bytes // 4)
    latency = statistics.median(f[0] for f in figures[False])
    print(f"  recording work per call (timeit, CPU time of one process): {work * 1e6:.2f} us = "
          f"{work / latency * 100:.2f}% of the {args.bytes} B latency above")
    paths = [call_path_seconds(args.bytes // 4) for _ in range(PATH_REPEATS)]
    extra = [with_path - without_path for with_path, without_path in paths]
    cost = statistics.median(extra)
    print(f"  whole call path on a 1-rank group (CPU time, one process, median of "
          f"{PATH_REPEATS}): recording {statistics.median(p[0] for p in paths) * 1e6:.2f} us, "
          f"off {statistics.median(p[1] for p in paths) * 1e6:.2f} us: {cost * 1e6:+.2f} us "
          f"per call ({_spread(extra)}) = {cost / latency * 100:+.2f}% of the {args.bytes} B "
          f"latency above")
    return 0
