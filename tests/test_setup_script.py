"""scripts/setup.sh: pip failures stop it with pip's own words; an unchanged set-up is skipped.

The script runs against a scratch copy of the project whose ``.venv/bin/python`` is a
stand-in shell script, so these tests take milliseconds and never touch the real venv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for .venv/bin/python: logs its arguments, fails pip when told to
echo "$*" >> "$(dirname "$0")/calls.log"
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  if [ -f "$(dirname "$0")/pip_fails" ]; then
    echo "ERROR: No matching distribution found for torch==2.13.0 (fake pip)"
    exit 1
  fi
  exit 0
fi
if [ "$1" = "-c" ]; then
  case "$2" in
    *sys.version*) echo "3.11.7 (fake)";;
    *print*) echo "tandem 0.1.0 on torch 2.13.0+cpu";;
  esac
  exit 0
fi
exit 0
"""


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", project / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", project / "pyproject.toml")
    bin_dir = project / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return project


def _setup(project: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=project, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ))


def _pip_calls(project: Path) -> list[str]:
    log = project / ".venv" / "bin" / "calls.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [line for line in lines if line.startswith("-m pip")]


def test_a_failing_pip_stops_setup_and_shows_pips_message(tmp_path: Path) -> None:
    project = _project(tmp_path)
    (project / ".venv" / "bin" / "pip_fails").touch()
    proc = _setup(project)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "No matching distribution found" in proc.stderr, proc.stderr
    assert "failed" in proc.stderr
    assert not (project / ".venv" / ".tandem-setup").exists(), "a failed set-up was stamped"


def test_setup_says_what_it_is_doing(tmp_path: Path) -> None:
    project = _project(tmp_path)
    proc = _setup(project)
    assert proc.returncode == 0, proc.stderr
    assert "installing torch 2.13.0" in proc.stdout and "installing tandem" in proc.stdout


def test_a_second_setup_with_nothing_changed_skips_pip(tmp_path: Path) -> None:
    project = _project(tmp_path)
    assert _setup(project).returncode == 0
    first = len(_pip_calls(project))
    assert first == 2, _pip_calls(project)
    proc = _setup(project)
    assert proc.returncode == 0 and "nothing changed" in proc.stdout, proc.stdout
    assert len(_pip_calls(project)) == first, "pip ran again though nothing changed"


def test_a_changed_pyproject_installs_again(tmp_path: Path) -> None:
    project = _project(tmp_path)
    assert _setup(project).returncode == 0
    with open(project / "pyproject.toml", "a") as f:
        f.write("\n# a new dependency would go here\n")
    proc = _setup(project)
    assert proc.returncode == 0 and "nothing changed" not in proc.stdout
    assert len(_pip_calls(project)) == 4, _pip_calls(project)


def test_setup_compiles_tandems_modules_every_time(tmp_path: Path) -> None:
    # a job's ranks read the compiled modules; without them, under PYTHONDONTWRITEBYTECODE,
    # every rank compiles tandem again (0.5 s of CPU each)
    project = _project(tmp_path)
    log = project / ".venv" / "bin" / "calls.log"
    for _ in range(2):  # the full set-up, then the one with nothing changed
        assert _setup(project).returncode == 0
        assert "-m compileall -q tandem" in log.read_text().splitlines(), log.read_text()
        log.write_text("")
