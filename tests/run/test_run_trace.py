"""What the launcher gathers for ``python -m tandem.trace``: before it stops a failed job
the live workers dump their flight recorders (beside the logs with ``--log-dir``), and a
job recorded with ``TANDEM_TIMELINE`` is merged into one file with a process per rank."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from runkit import SCRIPTS, Launch, Result, finish, wait_for_pids

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


@pytest.mark.timeout(120)
def test_after_ctrl_c_the_launcher_names_no_dump_written_before_it(
        launch: Launch, tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    proc = launch("--nproc-per-node", "2", SCRIPTS / "dumps_then_waits.py",
                  env={"TANDEM_TRACE_DIR": str(trace)})
    wait_for_pids(tmp_path, 2, proc)  # both dumped, then went on waiting in user code
    assert sorted(p.name for p in trace.iterdir()) == ["rank0.json", "rank1.json"]
    before = {p.name: p.stat().st_mtime_ns for p in trace.iterdir()}
    time.sleep(0.1)  # Ctrl-C comes well after the dumps (the launcher allows a clock tick)
    proc.send_signal(signal.SIGINT)
    res = finish(proc, 60)
    assert res.code == 128 + signal.SIGINT
    # a rank may dump again as it stops (its peer gone): only such dumps may be named
    again = [r for r in (0, 1) if (trace / f"rank{r}.json").stat().st_mtime_ns
             != before[f"rank{r}.json"]]
    named = [line for line in res.err.splitlines() if "flight recorders of" in line]
    if len(again) == 2:
        pytest.skip("both ranks dumped again as they stopped: nothing stale to leave out")
    assert named == ([f"tandemrun: flight recorders of rank {again[0]} in {trace}; 'python -m "
                      f"tandem.trace {trace}' says where the ranks diverged"] if again else []), \
        res.err
