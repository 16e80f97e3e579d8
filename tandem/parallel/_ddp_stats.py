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

__all__ = ["StepTimes", "DDPStats", "interval_union", "interval_overlap"]


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
