"""tandem.checkpoint: atomic saves that survive SIGKILL, clear load errors, saving on rank 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tandem import checkpoint
from tandem.errors import ArgumentError
from tandem.testing import launch, spawn

ROOT = Path(__file__).resolve().parents[1]


def _temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp." in p.name)


def test_model_and_optimizer_state_round_trip_with_weights_only(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 7,
             "rng": torch.get_rng_state(), "history": [(1, 0.5)]}
    checkpoint.save(state, tmp_path / "ckpt.pt")
    back = checkpoint.load(tmp_path / "ckpt.pt")  # weights_only=True by default
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    fresh.load_state_dict(back["optimizer"])
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"],
                       optimizer.state_dict()["state"][0]["exp_avg"])
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in back["model"].items())
    assert back["step"] == 7 and back["history"] == [(1, 0.5)]
    assert torch.equal(back["rng"], state["rng"])
    assert _temps(tmp_path) == []


def test_save_replaces_the_previous_checkpoint_and_creates_the_directory(tmp_path: Path) -> None:
    path = tmp_path / "new" / "dir" / "ckpt.pt"
    checkpoint.save({"step": 1}, path)
    checkpoint.save({"step": 2}, str(path))
    assert checkpoint.load(path) == {"step": 2}
    assert _temps(path.parent) == []


def test_a_failing_save_leaves_the_previous_checkpoint_and_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    checkpoint.save({"step": 1}, path)
    with pytest.raises(Exception):
        checkpoint.save({"step": 2, "bad": lambda: None}, path)  # cannot be pickled
    assert checkpoint.load(path) == {"step": 1}
    assert _temps(tmp_path) == []


KILLED_SAVER = textwrap.dedent("""
    import io, sys, time
    import torch
    from tandem import checkpoint

    real_save = torch.save

    def half_then_hang(obj, f):  # a save that is half written when the kill comes
        buf = io.BytesIO()
        real_save(obj, buf)
        data = buf.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        print("half written", flush=True)
        time.sleep(120)

    torch.save = half_then_hang
    checkpoint.save({"step": 2, "w": torch.arange(1_000_000.0)}, sys.argv[1])
""")


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_save_killed_midway_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    checkpoint.save({"step": 1, "w": torch.zeros(4)}, path)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVER, str(path)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert line.strip() == "half written", f"the saver failed: {line}{proc.stderr.read()}"
        temps = _temps(tmp_path)
        assert len(temps) == 1 and (tmp_path / temps[0]).stat().st_size > 0
        assert checkpoint.load(path)["step"] == 1  # still the old one while the save runs
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL

    state = checkpoint.load(path)
    assert state["step"] == 1 and torch.equal(state["w"], torch.zeros(4))
    assert checkpoint.latest(tmp_path) == str(path)  # the partial file is never a candidate
    assert len(_temps(tmp_path)) == 1  # left by the killed process ...
    checkpoint.save({"step": 3}, path)
    assert _temps(tmp_path) == []  # ... and cleaned by the next save of the same path
    assert checkpoint.load(path) == {"step": 3}


def test_a_temp_file_of_a_live_saver_is_not_removed(tmp_path: Path) -> None:
    live = tmp_path / f"ckpt.pt.tmp.{socket.gethostname()}.{os.getppid()}.abcd1234"
    other_host = tmp_path / f"ckpt.pt.tmp.another.host.{2**22 + 12345}.abcd1234"
    live.write_bytes(b"partial")
    other_host.write_bytes(b"partial")
    checkpoint.save({"step": 1}, tmp_path / "ckpt.pt")
    assert live.exists() and other_host.exists()


def test_loading_a_missing_checkpoint_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nothing.pt"
    with pytest.raises(FileNotFoundError, match=str(path)):
        checkpoint.load(path)
    assert not checkpoint.exists(path)


@pytest.mark.parametrize("content", [b"", b"garbage " * 20, "truncated"])
def test_loading_a_corrupt_checkpoint_names_the_path(tmp_path: Path, content: object) -> None:
    path = tmp_path / "bad.pt"
    if content == "truncated":
        checkpoint.save({"w": torch.zeros(1000)}, path)
        content = path.read_bytes()[:500]
    assert isinstance(content, bytes)
    path.write_bytes(content)
    with pytest.raises(ArgumentError, match=f"{path} is truncated, corrupt"):
        checkpoint.load(path)


class NotATensor:
    pass


def test_objects_that_could_run_code_need_weights_only_false(tmp_path: Path) -> None:
    path = tmp_path / "obj.pt"
    checkpoint.save({"thing": NotATensor()}, path)
    with pytest.raises(ArgumentError, match="weights_only=False"):
        checkpoint.load(path)
    assert isinstance(checkpoint.load(path, weights_only=False)["thing"], NotATensor)


def test_a_directory_or_a_non_path_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ArgumentError, match="is a directory"):
        checkpoint.load(tmp_path)
    with pytest.raises(ArgumentError, match="path must be"):
        checkpoint.save({}, 42)  # type: ignore[arg-type]


def test_latest_is_the_newest_complete_matching_file(tmp_path: Path) -> None:
    assert checkpoint.latest(tmp_path / "missing") is None
    assert checkpoint.latest(tmp_path) is None
    for step in (100, 200):
        checkpoint.save({"step": step}, tmp_path / f"step_{step:06d}.pt")
        time.sleep(0.01)
    (tmp_path / "step_000300.pt.tmp.host.1.abcd").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert checkpoint.latest(tmp_path) == str(tmp_path / "step_000200.pt")
    assert checkpoint.latest(tmp_path, "step_0001*.pt") == str(tmp_path / "step_000100.pt")


def _save_on_rank0_then_read(rank: int, world_size: int, path: str) -> object:
    checkpoint.save_on_rank0({"written_by": rank}, path)
    return checkpoint.load(path)  # every rank sees the file as soon as the call returns


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_save_on_rank0_writes_once_and_every_rank_sees_it(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt.pt")
    assert spawn(2, _save_on_rank0_then_read, (path,)) == [{"written_by": 0}] * 2
    assert _temps(tmp_path) == []


def _save_on_rank0_into_a_directory(rank: int, world_size: int, path: str) -> None:
    checkpoint.save_on_rank0({"written_by": rank}, path)


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_failed_save_on_rank0_raises_on_every_rank(tmp_path: Path) -> None:
    target = tmp_path / "is_a_dir"
    (target / "inside").mkdir(parents=True)  # os.replace cannot replace a non-empty directory
    outcomes = launch(2, _save_on_rank0_into_a_directory, (str(target),))
    assert not outcomes[0].ok and outcomes[0].error_type in ("IsADirectoryError", "OSError")
    assert not outcomes[1].ok and outcomes[1].error_type == "StateError", outcomes[1].error
    assert "rank 0 failed to save" in outcomes[1].error
