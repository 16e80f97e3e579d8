"""Signals to the launcher reach every worker, and no worker outlives the launcher."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from runkit import SCRIPTS, Launch, finish, wait_dead, wait_for_pids

pytestmark = pytest.mark.procs


@pytest.mark.timeout(90)
def test_sigterm_is_forwarded_and_every_worker_exits(launch: Launch, tmp_path: Path) -> None:
    proc = launch("--nproc-per-node", "2", SCRIPTS / "wait_for_signal.py", tmp_path)
    pids = wait_for_pids(tmp_path, 2, proc)
    proc.send_signal(signal.SIGTERM)
    res = finish(proc, 60)
    assert res.code == 128 + signal.SIGTERM
    assert "received SIGTERM" in res.err
    assert sorted(p.name for p in tmp_path.glob("got_*")) == ["got_SIGTERM_0", "got_SIGTERM_1"]
    assert wait_dead(pids, 5) == []


@pytest.mark.timeout(90)
def test_sigusr1_is_forwarded_and_the_job_goes_on(launch: Launch, tmp_path: Path) -> None:
    proc = launch("--nproc-per-node", "2", SCRIPTS / "wait_for_signal.py", tmp_path)
    wait_for_pids(tmp_path, 2, proc)
    proc.send_signal(signal.SIGUSR1)
    res = finish(proc, 60)
    assert res.code == 0, res.err  # the workers chose to exit 0 on SIGUSR1
    assert sorted(p.name for p in tmp_path.glob("got_*")) == ["got_SIGUSR1_0", "got_SIGUSR1_1"]


@pytest.mark.timeout(90)
def test_workers_ignoring_sigterm_are_killed_after_the_shutdown_timeout(
        launch: Launch, tmp_path: Path) -> None:
    proc = launch("--nproc-per-node", "2", "--shutdown-timeout", "1",
                  SCRIPTS / "wait_for_signal.py", tmp_path, "ignore")
    pids = wait_for_pids(tmp_path, 2, proc)
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    res = finish(proc, 60)
    assert res.code == 128 + signal.SIGINT
    assert time.monotonic() - start < 15
    assert sorted(p.name for p in tmp_path.glob("got_*")) == ["got_SIGINT_0", "got_SIGINT_1"]
    assert wait_dead(pids, 5) == []


@pytest.mark.timeout(90)
def test_workers_die_when_the_launcher_is_sigkilled(launch: Launch, tmp_path: Path) -> None:
    proc = launch("--nproc-per-node", "2", SCRIPTS / "wait_for_signal.py", tmp_path)
    pids = wait_for_pids(tmp_path, 2, proc)
    os.kill(proc.pid, signal.SIGKILL)
    finish(proc, 30)
    assert wait_dead(pids, 5) == []
