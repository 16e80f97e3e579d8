"""The main example's flags: --zero trains exactly like AdamW, --shard-grads and --uneven run.

Training in ``examples/train_chars.py`` is deterministic, so a run with the optimizer
state sharded over the ranks (``--zero``) must end with the very parameters of a plain
run. ``--shard-grads --uneven 3`` (ZeRO-2, rank 1 training 3 steps fewer under
``Join``) must finish, learn, and leave a checkpoint in the plain AdamW format.

Run: ``python -m pytest tests/optim/test_example_flags.py -q``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_chars.py"
STEPS = 12


def _start(out: Path, *flags: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.Popen([sys.executable, str(SCRIPT), "--quick", "--steps", str(STEPS),
                             "--save-every", "0", "--out", str(out), *flags],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.mark.timeout(300)
def test_zero_flags_train_like_the_plain_optimizer_and_uneven_ranks_finish(tmp_path: Path) -> None:
    runs = {"plain": (), "zero": ("--zero",), "uneven": ("--shard-grads", "--uneven", "3")}
    procs = {name: _start(tmp_path / name, *flags) for name, flags in runs.items()}
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=280)
        assert proc.returncode == 0, f"{name} run failed:\n{output}"
    states = {name: torch.load(tmp_path / name / "checkpoint.pt", map_location="cpu",
                               weights_only=True) for name in runs}
    for key, value in states["plain"]["model"].items():
        assert torch.equal(value, states["zero"]["model"][key]), f"--zero changed {key}"
    plain_opt, uneven_opt = states["plain"]["optimizer"], states["uneven"]["optimizer"]
    assert uneven_opt["param_groups"][0].keys() == plain_opt["param_groups"][0].keys()
    assert sorted(uneven_opt["state"]) == sorted(plain_opt["state"])
    metrics = json.loads((tmp_path / "uneven" / "metrics.json").read_text())
    assert metrics["steps"] == STEPS
    assert metrics["train_loss_last10"] < metrics["train_loss_first"], metrics
