"""How fast the launcher reacts to a SIGKILLed worker (the launcher issue's target:
restart, or fail with the root cause, within 2 x --monitor-interval plus the grace
period). Worker start-up is excluded: the scripts import nothing heavy."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import pytest

from runkit import SCRIPTS, Result

pytestmark = pytest.mark.procs

Run = Callable[..., Result]
INTERVAL = 0.5
GRACE = 2.0
# the bound, plus what a loaded 2-core machine needs to start a Python worker
SLACK = 2.0


@pytest.mark.timeout(90)
def test_a_killed_worker_is_restarted_within_two_intervals_and_the_grace(run: Run,
                                                                       tmp_path: Path) -> None:
    res = run("--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval",
              str(INTERVAL), "--shutdown-timeout", str(GRACE), SCRIPTS / "kill_then_mark.py",
              "1", str(tmp_path))
    assert res.code == 0, res.err
    killed = float((tmp_path / "killed_at").read_text())
    restarted = min(float(p.read_text()) for p in tmp_path.glob("restarted_*"))
    took = restarted - killed
    print(f"restart {took:.3f}s after the kill")
    assert took < 2 * INTERVAL + GRACE + SLACK, f"restart came {took:.2f}s after the kill"


@pytest.mark.timeout(90)
def test_a_killed_worker_ends_the_job_with_its_root_cause_promptly(launch: Callable[..., "object"],
                                                                 tmp_path: Path) -> None:
    start = time.time()
    res = run_to_end(launch, tmp_path)
    took = time.time() - float((tmp_path / "killed_at").read_text())
    assert res.code == 1 and "signal 9 (SIGKILL)" in res.err, res.err
    print(f"launcher exited {took:.3f}s after the kill")
    assert took < 2 * INTERVAL + GRACE + SLACK, f"the launcher exited {took:.2f}s after the kill"
    assert time.time() - start < 30


def run_to_end(launch: Callable[..., "object"], tmp_path: Path) -> Result:
    from runkit import finish

    proc = launch("--nproc-per-node", "2", "--monitor-interval", str(INTERVAL),
                  "--shutdown-timeout", str(GRACE), SCRIPTS / "kill_then_mark.py", "1",
                  str(tmp_path))
    return finish(proc, 60)  # type: ignore[arg-type]
