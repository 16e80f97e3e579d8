"""Helpers shared by the launcher tests (a uniquely named module: every test dir has a conftest)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Callable, NamedTuple

from tandem._proc import process_alive  # noqa: F401 - re-exported for the launcher tests

SCRIPTS = Path(__file__).parent / "scripts"

Launch = Callable[..., "subprocess.Popen[str]"]


class Result(NamedTuple):
    code: int
    out: str
    err: str


def worker_pids(directory: Path) -> list[int]:
    """The pids that workers wrote (atomically) to ``pid_<rank>`` files under ``directory``."""
    return [int(p.read_text()) for p in directory.rglob("pid_*") if p.name[4:].isdigit()]


def wait_for_pids(directory: Path, n: int, proc: subprocess.Popen[str]) -> list[int]:
    """Wait until ``n`` workers under ``directory`` noted their pids (the launcher lives on)."""
    deadline = time.monotonic() + 60
    while len(worker_pids(directory)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.05)
    return worker_pids(directory)


def wait_dead(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` for ``pids`` to die; those still alive."""
    deadline = time.monotonic() + timeout
    while [p for p in pids if process_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if process_alive(p)]


def finish(proc: subprocess.Popen[str], timeout: float = 120.0) -> Result:
    out, err = proc.communicate(timeout=timeout)
    return Result(proc.returncode, out, err)
