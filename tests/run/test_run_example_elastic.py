"""The main example under ``bash scripts/train.sh --elastic`` survives a ``kill -9`` from
outside, as the README shows: the surviving worker keeps its pid, the launcher starts a
replacement that joins at a commit, the run ends at full size with a verified checkpoint,
and no worker outlives the launcher."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from runkit import wait_dead

pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parents[2]
STEPS = 500
KILL_AFTER = 50  # rank 0 reports progress every STEPS // 10 steps
MEMBERS = re.compile(r"elastic, (\d+) ranks at step (\d+): (.*) \(kill -9")


def _members(line: str) -> tuple[int, dict[int, int]] | None:
    """(step, {rank: pid}) from the example's membership line, or None."""
    m = MEMBERS.search(line)
    if m is None:
        return None
    pids = dict((int(r), int(p)) for r, p in re.findall(r"rank (\d+) pid (\d+)", m.group(3)))
    assert len(pids) == int(m.group(1)), line
    return int(m.group(2)), pids


@pytest.mark.timeout(300)
def test_the_example_survives_a_kill_9_of_a_worker_from_outside(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.Popen(
        ["bash", "scripts/train.sh", "--elastic", "--quick", "--steps", str(STEPS),
         "--out", str(tmp_path / "run")],
        cwd=ROOT, env={**env, "NPROC": "2", "TANDEM_TRACE_DIR": str(tmp_path / "trace")},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    out: list[str] = []
    memberships: list[tuple[int, dict[int, int]]] = []
    killed = 0
    deadline = time.monotonic() + 240
    try:
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                break
            out.append(line)
            found = _members(line)
            if found is not None:
                memberships.append(found)
            if (not killed and memberships
                    and re.search(rf"step +{KILL_AFTER}/{STEPS} \|", line)):
                killed = memberships[0][1][1]  # rank 1's worker, as a user would pick it
                os.kill(killed, signal.SIGKILL)
            assert time.monotonic() < deadline, "the run took too long"
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    text = "".join(out)
    assert code == 0, text
    assert killed, f"no progress line for step {KILL_AFTER}:\n{text}"
    assert "recovered in place from 1 failure(s):" in text, text
    assert "rank 1 (local_rank 1, host" in text and "signal 9 (SIGKILL)" in text, text

    first, *later = memberships
    survivor = first[1][0]
    assert first == (0, {0: survivor, 1: killed}), memberships
    grown = [m for _, m in later if len(m) == 2]
    assert grown, f"the replacement never joined:\n{text}"
    replacement = grown[0][1]
    assert grown[0] == {0: survivor, 1: replacement} and replacement not in (survivor, killed)
    # the survivor goes on alone until the replacement joins at a commit; a replacement
    # already waiting when the survivor's recovery round closes (its warm start quicker
    # than the survivor noticing the loss, under load) is let in by that round instead
    assert [m for _, m in later] in ([{0: survivor}, grown[0]], [grown[0]]), memberships
    assert "worker n0.s1.1 admitted" in text, text
    assert "[rank0.1]" not in text, "rank 0's worker was replaced, not kept"

    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == STEPS and metrics["world_size"] == 2, metrics
    assert metrics["train_loss_last10"] < metrics["train_loss_first"] - 0.8, metrics
    assert "reloaded" in text and "tensors verified" in text, text
    assert (tmp_path / "trace" / "rank0.json").exists(), "the survivor kept no flight record"
    assert not wait_dead([survivor, killed, replacement], 10), "a worker outlived the launcher"
