"""The harness itself under faults: what ``tandem.testing.launch`` does when set-up fails.

(That it SIGKILLs a stopped rank at the deadline is checked in test_fault_timeouts.py.)
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from _fault_helpers import values
from tandem.testing import launch

pytestmark = pytest.mark.timeout(90)


def _rank_count(rank: int, world_size: int) -> int:
    return world_size


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
