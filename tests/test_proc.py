"""process_alive: the one answer to "is that process still there?" used by every sweep."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tandem._proc import process_alive


def test_a_running_process_is_alive() -> None:
    assert process_alive(os.getpid())


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
