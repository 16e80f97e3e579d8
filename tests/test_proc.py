"""process_alive: the one answer to "is that process still there?" used by every sweep;
process_stopped: whether it is held by SIGSTOP (the test harness stops waiting for it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tandem._proc import process_alive, process_stopped


def test_a_running_process_is_alive() -> None:
    assert process_alive(os.getpid())


@pytest.mark.procs
def test_a_zombie_is_dead_although_its_pid_still_exists() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    # not reaped: the child stays a zombie until wait() below
    while process_alive(child.pid):
        assert time.monotonic() < deadline, "the child neither exited nor was seen as a zombie"
        time.sleep(0.01)
    os.kill(child.pid, 0)  # the pid still exists: only its zombie state says it is dead
    assert child.wait(10) == 0
    assert not process_alive(child.pid)


def test_process_group_numbers_are_not_processes() -> None:
    assert not process_alive(0) and not process_alive(-os.getpid())


@pytest.mark.procs
def test_a_stopped_process_is_stopped_until_continued() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not process_stopped(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while not process_stopped(child.pid):
            assert time.monotonic() < deadline, "the child was never seen stopped"
            time.sleep(0.01)
        assert process_alive(child.pid)
        os.kill(child.pid, signal.SIGCONT)
        while process_stopped(child.pid):
            assert time.monotonic() < deadline, "the child was never seen running again"
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait(10)
    assert not process_stopped(child.pid)  # gone: neither stopped nor anything else
