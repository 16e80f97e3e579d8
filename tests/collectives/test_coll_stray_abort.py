"""A clash found in a message for a call this rank already completed (a stray) fails the
group on every member, not only on the rank that sent it.

Rank 4 names rank 5 as a broadcast's root while everyone else names rank 0, and calls
late, after rank 5 (which agreed with rank 0) has completed. Rank 5 then finds rank 4's
confirmation a stray. Rank 0, the real root, returned once its data was sent (its root
check across hosts completes by the end of its next call) or still waits for rank 4's
confirmation: either way it must learn of the clash at once, in the broadcast or in
its next call, instead of waiting out the whole operation timeout.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import tandem
from tandem.errors import TandemError
from tandem.testing import run_threads

pytestmark = [pytest.mark.timeout(120)]

HOSTS = list("aaabbbcc")  # ranks 3-5 on one host: 4's claim goes to 5 through its entry
LATE, NAMED = 4, 5
OP_TIMEOUT = 60.0


def _body(group: Any, named_done: threading.Event) -> tuple[str, float, str]:
    rank = group.rank()
    if rank == LATE:  # only once rank 5 completed is 4's message to it a stray
        assert named_done.wait(OP_TIMEOUT), "rank 5's broadcast never completed"
    start = time.monotonic()
    try:
        tandem.broadcast(torch.full((4,), float(rank)), src=NAMED if rank == LATE else 0,
                         group=group)
    except TandemError as exc:
        return type(exc).__name__, time.monotonic() - start, str(exc)
    finally:
        if rank == NAMED:
            named_done.set()
    if rank == 0:  # the root returned with its data sent: its next call learns of the clash
        try:
            tandem.barrier(group=group)
        except TandemError as exc:
            return "next call: " + type(exc).__name__, time.monotonic() - start, str(exc)
    return "returned", time.monotonic() - start, ""


@pytest.mark.parametrize("attempt", range(3))
def test_the_root_learns_of_a_stray_clash_at_once(attempt: int) -> None:
    out = run_threads(len(HOSTS), _body, (threading.Event(),), hosts=HOSTS,
                      timeout=OP_TIMEOUT + 30, op_timeout=OP_TIMEOUT)
    what, took, message = out[0]
    assert what in ("CollectiveMismatchError", "next call: CollectiveMismatchError",
                    "next call: StateError"), out
    assert "collective mismatch" in message, out  # a StateError: the group aborted by it
    assert took < 10, f"the root took {took:.1f} s to learn of the clash: {out}"
    assert out[NAMED][0] == "returned", out  # it agreed with rank 0, before rank 4 called
    assert out[LATE][0] == "CollectiveMismatchError", out
