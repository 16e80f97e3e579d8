"""Timing contenders in alternating rounds inside each rank process, for
``python -m tandem.bench torch-backend``.

A contender is a ``(barrier, step)`` pair: the barrier lines the ranks up on the
contender's own group before each round, ``step`` is one operation or training step.
Rounds rotate through the contenders so all see the same machine noise. A
:class:`CollectiveClock` adds a third clock to the wall and CPU ones: the time a step
spends inside torch's collective functions, so a reader can see how much of a step a
faster library could save at all.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any, Callable, Sequence

import torch

__all__ = ["CLOCKS", "Contender", "CollectiveClock", "best_rounds", "agreed_iters"]

CLOCKS = ("wall", "cpu")
Contender = tuple[Callable[[], object], Callable[[], object]]


class CollectiveClock:
    """While entered, sums the wall time spent in the named ``torch.distributed``
    functions (on any group: it runs inside one contender's round at a time).

    torch's FSDP2 calls ``torch.distributed.all_gather_single`` and friends through the
    module at every call, so timing wrappers put there see each of its collectives,
    whatever the backend. The wrappers cost about a microsecond per call, alike for
    every contender; leaving restores the functions.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.seconds = 0.0
        self.calls = 0
        self._saved: dict[str, Callable[..., Any]] = {}

    def _timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        return timed

    def __enter__(self) -> CollectiveClock:
        import torch.distributed as dist

        for name in self.names:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._timed(self._saved[name]))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        import torch.distributed as dist

        for name, call in self._saved.items():
            setattr(dist, name, call)
        self._saved.clear()


def best_rounds(contenders: dict[str, Contender], iters: dict[str, int], rounds: int,
                clock: CollectiveClock | None = None) -> dict[str, dict[str, list[float]]]:
    """Per clock ("wall"; "cpu": this process's CPU time, every thread; "collectives" when
    ``clock`` is given) and contender, seconds per iteration in each round; the order of
    the contenders rotates per round."""
    names = list(contenders)
    kinds = CLOCKS + (("collectives",) if clock is not None else ())
    times: dict[str, dict[str, list[float]]] = {c: {n: [] for n in names} for c in kinds}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            barrier, step = contenders[name]
            barrier()
            if clock is not None:
                clock.seconds = 0.0
            start, used = time.perf_counter(), time.process_time()
            for _ in range(iters[name]):
                step()
            times["wall"][name].append((time.perf_counter() - start) / iters[name])
            times["cpu"][name].append((time.process_time() - used) / iters[name])
            if clock is not None:
                times["collectives"][name].append(clock.seconds / iters[name])
    return times


def agreed_iters(contenders: dict[str, Contender], gloo: Any, round_s: float,
                 cap: int) -> dict[str, int]:
    """Iterations per round for each contender; every rank must run the same count."""
    import torch.distributed as dist

    est = []
    for barrier, step in contenders.values():
        barrier()
        start = time.perf_counter()
        step()
        est.append(time.perf_counter() - start)
    agreed = torch.tensor(est, dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=gloo)
    return {n: max(1, min(cap, int(round_s / max(e, 1e-9))))
            for n, e in zip(contenders, agreed.tolist())}
