"""The worker bootstrap on its own: parent checks and the error record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.run.workers import BOOTSTRAP

pytestmark = pytest.mark.timeout(60)


def bootstrap(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, BOOTSTRAP, *args], capture_output=True, text=True,
                          timeout=30, env=env)


def test_a_worker_whose_launcher_is_already_gone_exits_at_once(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    res = bootstrap("--parent", "1", str(script))  # pid 1 is not our parent
    assert res.returncode == 1 and not marker.exists()


def test_the_error_record_has_rank_host_type_message_and_traceback(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import sys\nassert sys.argv[1:] == ['a'], sys.argv\n"
                      "raise KeyError('missing')\n")
    error_file = tmp_path / "error.json"
    env = {**os.environ, "RANK": "5", "LOCAL_RANK": "1", "TANDEM_ERROR_FILE": str(error_file)}
    res = bootstrap("--parent", str(os.getpid()), str(script), "a", env=env)
    assert res.returncode == 1
    assert res.stderr.startswith("Traceback") and "KeyError: 'missing'" in res.stderr
    record = json.loads(error_file.read_text())
    assert (record["rank"], record["local_rank"], record["exc_type"]) == (5, 1, "KeyError")
    assert record["message"] == "'missing'" and record["host"]
    assert 's.py", line 3, in <module>' in record["traceback"]
    assert "runpy" not in record["traceback"]


def test_sys_exit_is_passed_through_without_a_record(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import sys\nsys.exit(7)\n")
    error_file = tmp_path / "error.json"
    env = {**os.environ, "TANDEM_ERROR_FILE": str(error_file)}
    res = bootstrap("--parent", str(os.getpid()), str(script), env=env)
    assert res.returncode == 7 and not error_file.exists()
