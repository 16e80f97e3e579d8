"""The main example's ``--sync``: ranks step alone and meet every ``--inner-steps`` steps.

Each rank records a digest of its parameters at every evaluation (``--eval-every``):
with ``--sync local-sgd --inner-steps 4`` the ranks hold the very same model at steps
0, 4, 8, ... and different ones in between (they train on different data and talk to
nobody); ``--sync diloco`` likewise once ``tandem.algorithms.diloco`` exists. The flags
themselves are checked without starting a rank.

Run: ``python -m pytest tests/algorithms/test_example_sync.py -q``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.bench.slow_links import load_example
from tandem.testing import spawn

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / "examples" / "train_chars" / "cli.py"
TINY = ["--quick", "--steps", "12", "--eval-every", "2", "--save-every", "0",
        "--dim", "32", "--batch-size", "4", "--seq-len", "32"]


def _rank(rank: int, world_size: int, out: str, store: str, flags: list[str]) -> list[Any]:
    """Train; return (model digest) at each evaluation, and rank 0's metrics."""
    script = load_example()
    from train_chars import trainer

    digests: list[str] = []
    plain = trainer.evaluate

    def evaluate(model: torch.nn.Module, ids: torch.Tensor, cfg: Any) -> float:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        digests.append(hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16])
        return plain(model, ids, cfg)  # type: ignore[arg-type]

    trainer.evaluate = evaluate
    cfg, ns = script.parse_args([*TINY, "--out", out, *flags])
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    script.run_rank(cfg, ns.threads, f"file://{store}", rank, world_size)
    metrics = json.loads((Path(out) / "metrics.json").read_text()) if rank == 0 else {}
    return [digests, metrics]


def _train(tmp_path: Path, name: str, flags: list[str]) -> tuple[list[list[str]], Any]:
    results = spawn(2, _rank, (str(tmp_path / name), str(tmp_path / f"{name}.store"), flags),
                    init=False, timeout=240)
    return [r[0] for r in results], results[0][1]


def _check_meets_every(digests: list[list[str]], metrics: Any, every: int) -> None:
    steps = [int(s) for s, _, _ in metrics["val_curve"]]
    assert steps == [0, 2, 4, 6, 8, 10, 12], metrics["val_curve"]
    seconds = [t for _, t, _ in metrics["val_curve"]]
    assert seconds == sorted(seconds) and seconds[-1] == metrics["elapsed_s"], seconds
    for at, (mine, theirs) in enumerate(zip(*digests)):
        step = steps[at]
        if step % every == 0:
            assert mine == theirs, f"the ranks' models differ at step {step}, a sync step"
        else:
            assert mine != theirs, f"the ranks' models are equal at step {step}: they synced"
    assert metrics["train_loss_last10"] < metrics["train_loss_first"], metrics


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_local_sgd_ranks_hold_one_model_at_every_inner_steps_th_step_only(
        tmp_path: Path) -> None:
    digests, metrics = _train(tmp_path, "local", ["--sync", "local-sgd", "--inner-steps", "4"])
    _check_meets_every(digests, metrics, 4)
    assert metrics["sync"] == "local-sgd" and metrics["inner_steps"] == 4
    state = torch.load(tmp_path / "local" / "checkpoint.pt", weights_only=True)
    assert state["optimizer"]["step"] == 12  # the averager's count, for a resumed run


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_diloco_ranks_hold_one_model_at_every_inner_steps_th_step_only(tmp_path: Path) -> None:
    if importlib.util.find_spec("tandem.algorithms.diloco") is None:
        pytest.skip("tandem.algorithms.diloco is not in this tree")
    digests, metrics = _train(tmp_path, "diloco", ["--sync", "diloco", "--inner-steps", "4",
                                                   "--outer-lr", "1.2", "--outer-momentum",
                                                   "0.5"])
    _check_meets_every(digests, metrics, 4)
    assert metrics["sync"] == "diloco" and metrics["sync_bytes_sent"] > 0
    # the outer optimizer DiLoCo stepped is the one the flags asked for
    state = torch.load(tmp_path / "diloco" / "checkpoint.pt", weights_only=True)
    group = state["sync"]["outer_optimizer"]["param_groups"][0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (1.2, 0.5, True), group
    assert (metrics["outer_lr"], metrics["outer_momentum"]) == (1.2, 0.5)


@pytest.mark.parametrize("flags, says", [
    (["--sync", "ddp", "--inner-steps", "3"], "--inner-steps 3: --sync ddp averages"),
    (["--sync", "local-sgd", "--fragments", "2"], "only --sync diloco syncs the model in"),
    (["--sync", "diloco", "--inner-steps", "0"], "--inner-steps 0: must be between 1 and"),
    (["--sync", "diloco", "--steps", "10", "--inner-steps", "11"], "and --steps (10)"),
    (["--sync", "diloco", "--inner-steps", "4", "--fragments", "5"],
     "--fragments 5: must be between 1 and --inner-steps (4)"),
    (["--sync", "local-sgd", "--zero"], "drop --zero"),
    (["--sync", "diloco", "--elastic"], "drop --zero, --shard-grads, --uneven"),
    (["--sync", "allreduce"], "invalid choice: 'allreduce'"),
    (["--eval-every", "-2"], "--eval-every -2: use 0"),
    (["--sync", "local-sgd", "--outer-lr", "1"], "--outer-lr 1.0: only --sync diloco has"),
    (["--outer-momentum", "0.5"], "--outer-momentum 0.5: only --sync diloco has"),
    (["--sync", "diloco", "--outer-lr", "0"], "--outer-lr 0.0: must be above 0 and at most"),
    (["--sync", "diloco", "--outer-lr", "nan"], "--outer-lr nan: must be above 0"),
    (["--sync", "diloco", "--outer-momentum", "1"],
     "--outer-momentum 1.0: must be at least 0 and below 1"),
])
def test_sync_flags_that_cannot_work_are_refused_naming_the_flag(
        flags: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("train_chars_cli", CLI)
    assert spec is not None and spec.loader is not None
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)  # the standard library only: no rank, no torch needed
    with pytest.raises(SystemExit) as end:
        cli.parse(flags)
    assert end.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.procs
def test_sync_flag_errors_name_the_flag_and_help_lists_the_methods() -> None:
    bad = subprocess.run([sys.executable, str(CLI), "--sync", "diloco", "--inner-steps", "4",
                          "--fragments", "5"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "--fragments 5: must be between 1 and --inner-steps (4)" in bad.stderr, bad.stderr
    shown = subprocess.run([sys.executable, str(CLI), "--help"], capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 3  # the help, then the caller stops
    for word in ("--sync {ddp,local-sgd,diloco}", "--inner-steps H", "--fragments N",
                 "--eval-every N", "streaming DiLoCo", "--outer-lr LR", "--outer-momentum M"):
        assert word in shown.stdout, word
