"""The harness itself under faults: what ``tandem.testing.launch`` does when set-up fails.

(That the stopped rank of a real timeout is SIGKILLed is checked in test_fault_timeouts.py.)
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from typing import Any

import pytest

from _fault_helpers import values
from tandem.testing import launch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(90)]


def _rank_count(rank: int, world_size: int) -> int:
    return world_size


@pytest.mark.smoke("tandem.testing")
def test_tcp_rendezvous_works_without_a_secret_in_the_parent(
        monkeypatch: Any, tmp_path: Any) -> None:
    monkeypatch.delenv("TANDEM_SECRET", raising=False)
    monkeypatch.delenv("TANDEM_SECRET_FILE", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # a fresh per-user secret, not ~
    assert values(launch(2, _rank_count, rendezvous="tcp", timeout=40), [0, 1]) == {0: 2, 1: 2}


UNPICKLABLE = lambda rank, world_size: None  # noqa: E731 - the point of the test


def test_launch_reports_why_a_rank_could_not_start() -> None:
    # the real error, not "can only join a started process" from the clean-up
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        launch(2, UNPICKLABLE, init=False, timeout=20)


def _one_stops_one_sleeps(rank: int, world_size: int, seconds: float) -> str:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(seconds)
    return "done"


def test_a_stopped_rank_is_killed_once_the_others_have_exited_not_before() -> None:
    start = time.monotonic()
    outcomes = launch(2, _one_stops_one_sleeps, (2.0,), init=False, timeout=60)
    took = time.monotonic() - start
    assert outcomes[0].ok and outcomes[0].value == "done", outcomes[0]
    assert outcomes[1].error == "stopped" and outcomes[1].exitcode == -signal.SIGKILL, \
        outcomes[1]
    assert 2.0 <= took < 40, took  # waited for rank 0's sleep, not for the deadline


def test_a_stopped_rank_beside_a_running_one_waits_for_the_deadline() -> None:
    start = time.monotonic()
    outcomes = launch(2, _one_stops_one_sleeps, (600.0,), init=False, timeout=3)
    assert [o.error for o in outcomes] == ["deadline", "deadline"], outcomes
    assert time.monotonic() - start >= 3
