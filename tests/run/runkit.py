"""Helpers shared by the launcher tests (a uniquely named module: every test dir has a conftest)."""

from __future__ import annotations

import subprocess
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


def finish(proc: subprocess.Popen[str], timeout: float = 120.0) -> Result:
    out, err = proc.communicate(timeout=timeout)
    return Result(proc.returncode, out, err)
