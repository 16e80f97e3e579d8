"""Resumable training end to end: the main job, SIGKILLed mid-training under
``--max-restarts 1``, resumes from its last checkpoint and ends with exactly the
parameters, optimizer state and loss history of a run that was never interrupted."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from runkit import SCRIPTS, Result

pytestmark = pytest.mark.procs

Run = Callable[..., Result]

STEPS, SAVE_EVERY, KILL_AT = 16, 6, 9  # checkpoint at step 6; steps 7-8 are lost and redone
TINY = ["--quick", "--steps", STEPS, "--save-every", SAVE_EVERY, "--corpus-mb", "0.1",
        "--dim", "32", "--layers", "1", "--seq-len", "32", "--batch-size", "4", "--seed", "3"]


def _train(run: Run, out: Path, kill_step: int) -> Result:
    return run("--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
               SCRIPTS / "train_chars_killed.py", "1", kill_step, *TINY, "--out", out,
               timeout=100)


@pytest.mark.timeout(150)
def test_a_killed_run_resumes_to_the_parameters_of_an_uninterrupted_run(
        run: Run, tmp_path: Path) -> None:
    killed = _train(run, tmp_path / "killed", KILL_AT)
    assert killed.code == 0, f"exit {killed.code}\n{killed.out}\n{killed.err}"
    assert f"SIGKILL before optimizer step {KILL_AT}" in killed.out, killed.out
    assert "attempt 0 failed (rank 1" in killed.err and "restart 1 of 1" in killed.err
    assert f"resuming at step {SAVE_EVERY} (restart 1)" in killed.out, killed.out

    clean = _train(run, tmp_path / "clean", 0)
    assert clean.code == 0, f"exit {clean.code}\n{clean.out}\n{clean.err}"
    assert "restart" not in clean.err and "from scratch" in clean.out

    got = torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=True)
    want = torch.load(tmp_path / "clean" / "checkpoint.pt", weights_only=True)
    assert got["step"] == want["step"] == STEPS
    differ = [name for name, t in want["model"].items() if not torch.equal(t, got["model"][name])]
    assert not differ, f"parameters differ from the uninterrupted run's: {differ}"
    for index, slots in want["optimizer"]["state"].items():
        for slot, t in slots.items():
            assert torch.equal(t, got["optimizer"]["state"][index][slot]), (index, slot)
    assert got["history"] == want["history"], "per-step training losses differ"
    assert not list((tmp_path / "killed").glob("*.tmp.*")), "a temporary file was left"
