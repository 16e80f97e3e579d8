"""Where a DDP step spends its time: ``ddp.stats.last`` and ``ddp.stats.mean``.

All times are wall-clock seconds measured in the rank's own process::

    ddp = DistributedDataParallel(model)
    ...train...
    print(ddp.stats)             # one line: last step and the running mean
    ddp.stats.last.comm_s        # the numbers, as a StepTimes
    ddp.stats.reset()

``backward_s`` runs from the first backward node of the DDP outputs to the moment
the averaged gradients are in ``.grad``. ``comm_s`` counts the time during which at
least one bucket's reduction was in flight (issued, not yet complete);
``overlap_s`` is the part of it that ran while backward was still computing, and
``wait_s`` is the time backward was blocked on communication instead (reducing the
last bucket, then waiting for the others), so ``comm_s ~ overlap_s + wait_s``.
"""

from __future__ import annotations

import dataclasses

__all__ = ["StepTimes", "DDPStats", "interval_union", "interval_overlap", "step_times"]


@dataclasses.dataclass
class StepTimes:
    forward_s: float = 0.0
    backward_s: float = 0.0
    comm_s: float = 0.0
    overlap_s: float = 0.0
    wait_s: float = 0.0
    buckets: int = 0
    bytes: int = 0

    def __str__(self) -> str:
        return (f"forward {self.forward_s * 1e3:.2f} ms, backward {self.backward_s * 1e3:.2f} ms, "
                f"comm {self.comm_s * 1e3:.2f} ms ({self.overlap_s * 1e3:.2f} ms overlapped, "
                f"{self.wait_s * 1e3:.2f} ms waited), {self.buckets} buckets, "
                f"{self.bytes / 1e6:.2f} MB")


class DDPStats:
    """Timing of the last synchronised step and the running mean over all of them."""

    def __init__(self) -> None:
        self.steps = 0
        self.last = StepTimes()
        self._sum = StepTimes()
        self.pending_forward_s = 0.0

    def record(self, step: StepTimes) -> None:
        self.steps += 1
        self.last = step
        for f in dataclasses.fields(StepTimes):
            setattr(self._sum, f.name, getattr(self._sum, f.name) + getattr(step, f.name))

    @property
    def mean(self) -> StepTimes:
        if self.steps == 0:
            return StepTimes()
        n = self.steps
        return StepTimes(**{f.name: getattr(self._sum, f.name) / n
                            for f in dataclasses.fields(StepTimes)})

    def reset(self) -> None:
        self.steps = 0
        self.last = StepTimes()
        self._sum = StepTimes()

    def __repr__(self) -> str:
        return f"<DDPStats {self.steps} steps; last: {self.last}; mean: {self.mean}>"


def interval_union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping ``(start, end)`` spans."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def interval_overlap(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of the (merged) ``spans`` that fall inside ``[start, end]``."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)


def step_times(spans: list[tuple[float, float]], inline: tuple[float, float], forward_s: float,
               t_backward: float, t_compute_end: float, t_waited: float, t_end: float,
               nbytes: int) -> StepTimes:
    """One backward's figures from its buckets' ``(launch, done)`` spans.

    ``inline`` is when backward itself was blocked reducing the last bucket ((0, 0):
    never); backward computed from ``t_backward`` to ``t_compute_end``, waited for
    the reductions until ``t_waited`` and wrote the results back until ``t_end``.
    """
    merged = interval_union(spans)
    blocked_from, blocked_to = inline
    if blocked_to == 0.0:
        blocked_from = blocked_to = t_compute_end
    # communication overlapped backward only while backward was computing
    overlap = (interval_overlap(merged, t_backward, blocked_from)
               + interval_overlap(merged, blocked_to, t_compute_end))
    return StepTimes(
        forward_s=forward_s,
        backward_s=t_end - t_backward,
        comm_s=sum(b - a for a, b in merged),
        overlap_s=overlap,
        wait_s=t_waited - t_compute_end + (blocked_to - blocked_from),
        buckets=len(spans),
        bytes=nbytes,
    )
