"""What the launcher gathers for ``python -m tandem.trace``: before it stops a failed job
the live workers dump their flight recorders (beside the logs with ``--log-dir``), and a
job recorded with ``TANDEM_TIMELINE`` is merged into one file with a process per rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from runkit import SCRIPTS, Result

pytestmark = pytest.mark.procs

Run = Callable[..., Result]


def _line(path: Path, marker: str) -> int:
    lines = path.read_text().splitlines()
    return next(i for i, ln in enumerate(lines, start=1) if ln.rstrip().endswith(f"# {marker}"))


@pytest.mark.timeout(120)
def test_live_workers_dump_their_flight_recorders_before_the_job_is_stopped(
        run: Run, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    res = run("--nproc-per-node", "2", "--log-dir", logs, "--rdzv-id", "job1",
              SCRIPTS / "stuck_behind.py")
    assert res.code == 1 and "ValueError: bad batch" in res.err, res.err
    trace = logs / "job1" / "attempt_0" / "trace"
    assert f"tandemrun: flight recorders of rank 0 in {trace}; 'python -m tandem.trace " \
           f"{trace}' says where the ranks diverged" in res.err, res.err
    data = json.loads((trace / "rank0.json").read_text())
    assert "SIGUSR1" in data["reasons"], data["reasons"]
    line = _line(SCRIPTS / "stuck_behind.py", "rank-0-waits")
    assert data["main_thread"] in (f"stuck_behind.py:{line - 1} in <module>",
                                   f"stuck_behind.py:{line} in <module>"), data["main_thread"]
    report = subprocess.run([sys.executable, "-m", "tandem.trace", str(trace)],
                            capture_output=True, text=True, timeout=60).stdout
    assert "flight recorders of rank 0 (1 of 2)" in report, report
    assert "rank 1 died" in report or "rank 1 wrote no dump" in report, report


@pytest.mark.timeout(120)
def test_the_launcher_merges_the_ranks_timelines(run: Run, tmp_path: Path) -> None:
    path = tmp_path / "out" / "trace.json"
    res = run("--nproc-per-node", "2", SCRIPTS / "timeline_job.py",
              env={"TANDEM_TIMELINE": str(path)})
    assert res.code == 0, res.err
    assert f"tandemrun: timeline of ranks 0-1 merged into {path}" in res.err, res.err
    events = json.loads(path.read_text())["traceEvents"]
    for rank in (0, 1):
        calls = [e for e in events if e["pid"] == rank and e["name"] == "all_reduce"]
        assert len(calls) == 3, (rank, [e["name"] for e in events if e["pid"] == rank])
