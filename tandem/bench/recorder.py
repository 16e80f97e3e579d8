"""What the flight recorder costs: 4 KB all_reduce with recording on and off.

Run::

    python -m tandem.bench recorder             # 2 ranks, backend auto, ~1 min
    python -m tandem.bench recorder --backend tcp

Every call on a group is recorded (``tandem.collectives.recorder``): one small list per
call (sequence number, op, signature, call site, size, start and end times) goes into
the group's ring at its sequence number (one clock read more than an unrecorded call);
the per-op totals are added up once per lap of the ring. The budget is 2% of a 4 KB
all_reduce: the in-place figure below, median over its runs (``--in-place-runs``, 9: a
process pair's figure moves by about +-1.5 us, more than the budget, so one run of five
pairs landed over 2% in 2 of 6 runs whose 30 pairs had a median of +1.3%).

Three measurements, most trusted first:

* in place: the same two rank processes turn recording on and off on their group
  every few hundred calls (the order alternating per pair of rounds), and the median
  paired difference is reported, plus what the ring's adding up costs per call (timed
  in laps of steady recording afterwards: once per 2,000 calls, it falls in one
  recorded round in eight, which the median leaves out), per process pair and over
  all pairs. Differences
  between process pairs (memory layout, placement) cancel out within a pair; between
  pairs the difference itself moves by about +-1 us, hence several pairs. The stall
  watchdog runs in both modes.
* fresh process pairs per mode: as shipped against ``TANDEM_FLIGHT_RECORDER=0`` and
  ``TANDEM_STALL_WARN=0`` (no recording, no watchdog), alternating, each run's best
  round. Run-to-run noise on a shared machine is about as large as the effect.
* the recording work alone in one process (``timeit``), and the whole call path on a
  one-rank group with recording on and off. In place the same steps cost 2-3x more:
  the rest of a 2-rank call's memory evicts theirs between calls. The ranks' shares
  overlap only in part: recording on one rank alone measured +0.6 to +1.9 us, on both
  +1.7 to +1.9 us (at load 45, so roughly).

For steadier figures on a busy machine, run it at real-time priority as root
(``chrt -f 10 python -m tandem.bench recorder``): other processes then wait.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Sequence

import torch

from tandem.bench._latency import all_reduce_latency, alternate

__all__ = ["main", "recording_seconds"]

OFF = {"TANDEM_FLIGHT_RECORDER": "0", "TANDEM_STALL_WARN": "0"}
PATH_REPEATS = 5
PAIRS = 40
BUDGET = 0.02  # of a 4 KB all_reduce's latency (issue 12)


def _rank(rank: int, world_size: int, numel: int, iters: int, rounds: int) -> tuple[float, float]:
    return all_reduce_latency(numel, iters, rounds)


def _paired_rank(rank: int, world_size: int, numel: int, iters: int, pairs: int
                 ) -> tuple[float, float, float, float]:
    """In a rank: medians of wall time per call with recording on, off, and of the paired
    difference, recording toggled on the default group between rounds (order alternating
    per pair; the watchdog runs throughout); then the time the ring's adding up takes
    per recorded call, in laps of a job that keeps recording (:func:`_lap_seconds`)."""
    import tandem
    from tandem.collectives.world import world

    recorder = world().process_groups()[0].recorder
    capacity = recorder.capacity
    tensor = torch.ones(numel)
    for _ in range(capacity + iters):  # warm-up, and a full ring: eviction is part of the cost
        tandem.all_reduce(tensor)
    on, off, diff = [], [], []
    for pair in range(pairs):
        seconds = {}
        for recording in ((True, False) if pair % 2 == 0 else (False, True)):
            recorder.capacity = capacity if recording else 0
            tandem.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                tandem.all_reduce(tensor)
            seconds[recording] = (time.perf_counter() - start) / iters
        on.append(seconds[True])
        off.append(seconds[False])
        diff.append(seconds[True] - seconds[False])
    recorder.capacity = capacity
    return (statistics.median(on), statistics.median(off), statistics.median(diff),
            _lap_seconds(recorder, tensor))


def _lap_seconds(recorder: Any, tensor: torch.Tensor) -> float:
    """Seconds per call that the ring's adding up (``Recorder.lap``, once per lap) takes
    in place, recording throughout: the median lap after the first over three laps
    (the first finds the gaps the toggled rounds left). Rounds of a few hundred calls
    leave it out of the paired median, as seven recorded rounds in eight have no lap."""
    import tandem

    laps: list[float] = []
    real = recorder.lap

    def timed(seq: int) -> None:
        start = time.perf_counter()
        real(seq)
        laps.append(time.perf_counter() - start)

    recorder.lap = timed
    try:
        for _ in range(3 * recorder.capacity + 1):
            tandem.all_reduce(tensor)
    finally:
        del recorder.lap
    return statistics.median(laps[1:]) / recorder.capacity


def recording_seconds(numel: int = 1024) -> float:
    """Per-call cost of recording one blocking collective, timed in this process: the
    steps ``ProcessGroup._execute`` takes when recording is on."""
    import timeit

    from tandem.collectives.recorder import Call, Recorder, clock

    recorder = Recorder(2000, "default")
    nbytes = numel * 4
    sig, site = b"all_reduce float32[1024] op=SUM algorithm=shm", b"train.py:42"
    seq = iter(range(10 ** 9))

    def record() -> None:
        # every call makes its op whether it is recorded or not; making one here (timed
        # too) is not recording's cost, so this errs high
        call = Call()
        call.op, call.seq, call.sig, call.site = "all_reduce", next(seq), sig, site
        capacity = recorder.capacity
        if capacity:
            now = clock()  # the deadline's reading: not recording's either
            i = call.seq % capacity
            if not i:
                recorder.lap(call.seq)
            record = [call.seq, call.op, call.sig, call.site, nbytes, 0.0, now, call, ""]
            try:
                recorder.ring[i] = record
            except IndexError:
                recorder.grow(i, record)
            record[7] = clock()

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
    parser.add_argument("--in-place-runs", type=int, default=9,
                        help="process pairs that toggle recording in place")
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args(argv)
    from tandem.testing import spawn

    if args.in_place_runs < 1:
        parser.error("--in-place-runs must be at least 1")
    print(f"all_reduce {args.bytes} B, 2 ranks, backend {args.backend}: recording on and off "
          f"in the same processes, alternating every {args.iters // 2} calls ({PAIRS} pairs; "
          f"medians; {args.in_place_runs} runs)", flush=True)
    shares = []
    for _ in range(args.in_place_runs):
        on, off, diff, lap = spawn(2, _paired_rank, (args.bytes // 4, args.iters // 2, PAIRS),
                                   backend=args.backend, timeout=600, op_timeout=120)[0]
        shares.append((diff + lap) / off)
        print(f"  in place: recording {on * 1e6:6.1f} us, off {off * 1e6:6.1f} us, paired "
              f"difference {diff * 1e6:+.2f} us, adding up laps {lap * 1e6:.2f} us: "
              f"{(diff + lap) * 1e6:+.2f} us = {shares[-1] * 100:+.1f}%", flush=True)
    median = statistics.median(shares)
    print(f"  in place, median of {len(shares)} runs: {median * 100:+.1f}% "
          f"({'within' if median < BUDGET else 'over'} the {BUDGET:.0%} budget)")
    figures = alternate(args.runs, lambda off: spawn(
        2, _rank, (args.bytes // 4, args.iters, args.rounds), backend=args.backend, timeout=600,
        op_timeout=120, env=OFF if off else {}))
    print(f"fresh process pairs per mode (recorder and watchdog on, or both off), median of "
          f"{args.runs} runs per mode (each the best of {args.rounds} rounds x {args.iters})")
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
