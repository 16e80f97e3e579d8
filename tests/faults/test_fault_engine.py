"""A progress engine that fails outside an operation aborts its group, never dies silently."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem.collectives import api
from tandem.collectives.group import ProcessGroup
from tandem.collectives.work import Work
from tandem.errors import TandemError
from tandem.testing import run_threads

pytestmark = pytest.mark.timeout(60)


def test_an_engine_that_raises_fails_queued_work_and_aborts_the_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = Work._complete
    first: list[Work] = []

    def broken(self: Work, result: Any = None, error: BaseException | None = None) -> None:
        if not first and "rank 0 of 2" in self._describe:
            first.append(self)  # rank 0's first async op
        if first and self is first[0]:  # completing it fails, with its result and with its error
            raise RuntimeError("a bug in the engine")
        real(self, result, error)

    def body(g: ProcessGroup) -> Any:
        outcomes = []
        works = []
        for _ in range(3):
            try:  # issuing fails at once when the group is already aborted
                works.append(api.all_reduce(torch.ones(4), group=g, async_op=True))
            except TandemError as exc:
                outcomes.append(type(exc).__name__ + ": " + str(exc))
        for i, w in enumerate(works):
            if g.group_rank == 0 and i == 0:
                continue  # it can never complete: completing it is what fails
            try:
                w.wait(timeout=5.0)
                outcomes.append("ok")
            except TandemError as exc:
                outcomes.append(type(exc).__name__ + ": " + str(exc))
        return outcomes

    monkeypatch.setattr(Work, "_complete", broken)
    results = run_threads(2, body, op_timeout=5.0)
    # rank 0's queued ops fail with its engine's error; rank 1 is told, and waits no longer
    assert results[0] and all(o.startswith("StateError") and "a bug in the engine" in o
                              for o in results[0]), results
    assert any("a bug in the engine" in o for o in results[1]), results
    flat = [o for r in results for o in r]
    assert not any("did not complete within" in o for o in flat), results
