"""Small-message latency runs shared by the ``signature`` and ``recorder`` benchmarks.

Both compare tandem as shipped with tandem with one feature turned off, in fresh pairs
of rank processes per run (toggling inside one process gave biased figures), the two
kinds of run alternating so that both see the same machine noise.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

__all__ = ["all_reduce_latency", "alternate"]

Figures = tuple[float, float]  # (wall, CPU) seconds per call


def all_reduce_latency(numel: int, iters: int, rounds: int) -> Figures:
    """In a rank: the best round's wall and CPU time per blocking all_reduce."""
    import tandem

    tensor = torch.ones(numel)
    for _ in range(iters // 4):  # warm-up
        tandem.all_reduce(tensor)
    wall = cpu = float("inf")
    for _ in range(rounds):
        tandem.barrier()
        start, used = time.perf_counter(), time.process_time()
        for _ in range(iters):
            tandem.all_reduce(tensor)
        wall = min(wall, (time.perf_counter() - start) / iters)
        cpu = min(cpu, (time.process_time() - used) / iters)
    return wall, cpu


def alternate(runs: int, one_run: Callable[[bool], list[Figures]]) -> dict[bool, list[Figures]]:
    """``one_run(off)`` per mode, ``runs`` times, alternating which mode goes first.

    Each run's figure is its slowest rank's (the collective waits for it).
    """
    figures: dict[bool, list[Figures]] = {False: [], True: []}
    for run in range(runs):
        for off in ((False, True) if run % 2 == 0 else (True, False)):
            per_rank = one_run(off)
            figures[off].append((max(w for w, _ in per_rank), max(c for _, c in per_rank)))
    return figures
