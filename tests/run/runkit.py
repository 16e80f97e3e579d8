"""Helpers shared by the launcher tests (a uniquely named module: every test dir has a conftest)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Callable, NamedTuple

from tandem.transport._shmem import process_alive

SCRIPTS = Path(__file__).parent / "scripts"

Launch = Callable[..., "subprocess.Popen[str]"]


class Result(NamedTuple):
    code: int
    out: str
    err: str


def pid_alive(pid: int) -> bool:
    if not process_alive(pid):
        return False
    try:  # a zombie is dead for our purposes (its parent has not reaped it yet)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def worker_pids(directory: Path) -> list[int]:
    """The pids that workers wrote (atomically) to ``pid_<rank>`` files under ``directory``."""
    return [int(p.read_text()) for p in directory.rglob("pid_*") if p.name[4:].isdigit()]


def finish(proc: subprocess.Popen[str], timeout: float = 120.0) -> Result:
    out, err = proc.communicate(timeout=timeout)
    return Result(proc.returncode, out, err)
