"""Fixtures for the launcher tests: a clean environment and launchers that never leak.

``launch(*args)`` starts ``python -m tandem.run ARGS`` as a child process and
``finish(proc)`` (in :mod:`runkit`) collects its exit code and output; at teardown every
launcher still running is SIGKILLed, and so is every worker pid found in a ``pid_*``
file under the test's temporary directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

from runkit import Launch, Result, finish, process_alive, worker_pids


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No inherited secret or PET_* flag changes what a test launches."""
    for name in list(os.environ):
        if name.startswith("PET_") or name in ("TANDEM_SECRET", "TANDEM_SECRET_FILE",
                                               "OMP_NUM_THREADS"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TANDEM_CONNECT_TIMEOUT", "60")
    monkeypatch.setenv("TANDEM_TIMEOUT", "60")


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launch]:
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.run", *map(str, args)], cwd=tmp_path,
            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    for pid in worker_pids(tmp_path):
        if process_alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def run(launch: Launch) -> Callable[..., Result]:
    """``run(*args, env=..., timeout=...)``: launch and wait for the launcher's result."""

    def go(*args: str, env: dict[str, str] | None = None, timeout: float = 120.0) -> Result:
        return finish(launch(*args, env=env), timeout)

    return go
