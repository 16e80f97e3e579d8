"""The main example's flags: --zero trains exactly like AdamW, --shard-grads and --uneven run.

Training in ``examples/train_chars.py`` is deterministic, so a run with the optimizer
state sharded over the ranks (``--zero``) must end with the very parameters of a plain
run. ``--shard-grads --uneven 3`` (ZeRO-2, rank 1 training 3 steps fewer under
``Join``) must finish, learn, and leave a checkpoint in the plain AdamW format.

Run: ``python -m pytest tests/optim/test_example_flags.py -q``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tandem.testing import spawn

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_chars.py"
STEPS = 12

pytestmark = pytest.mark.procs


def _script() -> ModuleType:
    """examples/train_chars.py itself (its package, examples/train_chars/, shares the name)."""
    examples = str(SCRIPT.parent)
    if examples not in sys.path:
        sys.path.insert(0, examples)
    spec = importlib.util.spec_from_file_location("train_chars_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank(rank: int, world_size: int, out: str, store: str, flags: list[str]) -> None:
    # the script's own flag parsing and rank entry point, in a rank forked with torch loaded
    # (a fresh interpreter per rank cost most of this test's time: 9 of them, ~130 s)
    script = _script()
    cfg, ns = script.parse_args(["--quick", "--steps", str(STEPS), "--save-every", "0",
                                 "--out", out, *flags])
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    script.run_rank(cfg, ns.threads, f"file://{store}", rank, world_size)


@pytest.mark.timeout(300)
def test_zero_flags_train_like_the_plain_optimizer_and_uneven_ranks_finish(tmp_path: Path) -> None:
    runs = {"plain": [], "zero": ["--zero"], "uneven": ["--shard-grads", "--uneven", "3"]}
    for name, flags in runs.items():
        spawn(2, _rank, (str(tmp_path / name), str(tmp_path / f"{name}.store"), flags),
              init=False, timeout=240)
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
