"""The main job: examples/train_chars.py --quick trains 2 ranks with tandem DDP end to end,
and meets a user as promised: a progress bar on a terminal (under tandemrun too), plain
lines elsewhere, a directory per run, resumes that say what changed, --help that says
how many processes run and --nproc that cannot contradict the launcher."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
import zlib
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_chars.py"


def _check_png(path: Path) -> tuple[int, int]:
    """Walk the chunks, checking every CRC; return (width, height)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    pos, kinds, size = 8, [], (0, 0)
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"bad CRC in {kind!r}"
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        kinds.append(kind)
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    return size


@pytest.mark.timeout(200)
def test_quick_run_trains_checkpoints_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "reloaded" in proc.stdout and "sample:" in proc.stdout, proc.stdout

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 30
    assert metrics["train_loss_last10"] < metrics["train_loss_first"] - 0.8, metrics
    assert metrics["val_loss_end"] < metrics["val_loss_start"] - 0.5, metrics

    state = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert state["step"] == 30 and state["optimizer"]["state"]
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from train_chars.model import CharTransformer, ModelConfig
    finally:
        sys.path.remove(str(ROOT / "examples"))
    CharTransformer(ModelConfig(**state["model_config"])).load_state_dict(state["model"])

    width, height = _check_png(out / "loss.png")
    assert width >= 100 and height >= 100
    assert not list(out.glob("*.tmp.*")), "a temporary checkpoint file was left behind"


TINY = ["--quick", "--corpus-mb", "0.1", "--dim", "32", "--layers", "1", "--seq-len", "32",
        "--batch-size", "4", "--save-every", "0"]


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TANDEM_SECRET",
            "TANDEM_RESTART_COUNT", "TANDEM_RUN_ID", "NPROC", "COLUMNS")
    return {k: v for k, v in os.environ.items() if k not in drop}


def tandemrun(cwd: Path, nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tandem.run", "--nproc-per-node", str(nproc),
                           str(SCRIPT), *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=150)


def on_a_terminal(cwd: Path, *argv: str, timeout: float = 150) -> tuple[int, str]:
    """Run ``argv`` with its output on a pseudo-terminal 100 columns wide."""
    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    proc = subprocess.Popen(argv, cwd=cwd, env=_env(), stdin=side, stdout=side, stderr=side)
    os.close(side)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([main], [], [], 0.2)[0]:
                try:
                    data = os.read(main, 1 << 16)
                except OSError:  # EIO: every writer is gone
                    break
                if not data:
                    break
                out += data
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), out.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(main)


@pytest.mark.timeout(300)
def test_runs_get_their_own_directories_and_a_resume_says_what_changed(tmp_path: Path) -> None:
    runs = tmp_path / "runs" / "train_chars"
    # on a terminal, through the launcher: rank 0 draws a bar, redrawn in place
    code, screen = on_a_terminal(tmp_path, sys.executable, "-m", "tandem.run",
                                 "--nproc-per-node", "2", str(SCRIPT), *TINY, "--steps", "6")
    assert code == 0, screen
    assert "\r[rank0]: " in screen and "6/6 [" in screen, screen  # tqdm's, with the prefix
    assert "[rank1]" not in screen
    first = json.loads((runs / "run_001" / "metrics.json").read_text())
    assert first["steps"] == 6

    # elsewhere: plain lines; a resume with another number of ranks says the batch changed
    res = tandemrun(tmp_path, 1, *TINY, "--steps", "9", "--resume")
    assert res.returncode == 0, res.stderr
    assert "\r" not in res.stderr and "[rank0]: step     9/9 | loss" in res.stderr, res.stderr
    assert "resuming at step 6 (--resume)" in res.stdout
    assert "trained on 2 ranks and this run has 1: the global batch changes from 8 to 4" \
        in res.stdout, res.stdout
    state = torch.load(runs / "run_001" / "checkpoint.pt", weights_only=True)
    metrics = json.loads((runs / "run_001" / "metrics.json").read_text())
    assert state["step"] == 9 and metrics["steps_this_run"] == 3
    assert metrics["train_loss_first"] == state["history"][6][1]  # step 7: this run's first
    assert f"loss: train {state['history'][6][1]:.3f} -> " in res.stdout

    # a named directory that holds a run is not overwritten; a new run gets its own
    res = tandemrun(tmp_path, 2, *TINY, "--steps", "3", "--out", str(runs / "run_001"))
    assert res.returncode == 1
    # once, from rank 0 alone: not left to the launcher merging copies that arrive close
    assert res.stderr.count("holds the checkpoint of an earlier run (step 9)") == 1, res.stderr
    assert f"[rank0]: train_chars: {runs / 'run_001'} holds the checkpoint" in res.stderr
    res = tandemrun(tmp_path, 2, *TINY, "--steps", "3")
    assert res.returncode == 0, res.stderr
    assert json.loads((runs / "run_002" / "metrics.json").read_text())["steps"] == 3
    assert torch.load(runs / "run_001" / "checkpoint.pt", weights_only=True)["step"] == 9


@pytest.mark.timeout(120)
def test_help_says_how_many_processes_and_the_launcher_decides(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    assert "processes:" in res.stdout and "NPROC=N" in res.stdout
    assert "scripts/train.sh" in res.stdout and "runs/train_chars/run_NNN" in res.stdout
    for nproc in ("3", "2"):  # even one that agrees: under a launcher, the launcher decides
        res = tandemrun(tmp_path, 2, *TINY, "--nproc", nproc)
        assert res.returncode == 1
        assert res.stderr.count(f"--nproc {nproc}: a launcher started this run with 2 ranks") \
            == 1, res.stderr
        assert f"[rank0]: train_chars.py: error: --nproc {nproc}:" in res.stderr  # rank 0's
        assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(150)
def test_careless_values_are_refused_with_the_flag_named(tmp_path: Path) -> None:
    for flag, value in (("--lr", "nan"), ("--corpus-mb", "0"), ("--steps", "0")):
        res = subprocess.run([sys.executable, str(SCRIPT), *TINY, flag, value], cwd=tmp_path,
                             env=_env(), capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and f"{flag} must be positive" in res.stderr, res.stderr
    # longer windows than the text read: said before training, not a ZeroDivisionError
    res = tandemrun(tmp_path, 1, *TINY, "--seq-len", "1000000")
    assert res.returncode == 1
    assert "--seq-len 1000000: the text read" in res.stderr, res.stderr[-2000:]
    assert "ZeroDivisionError" not in res.stderr
