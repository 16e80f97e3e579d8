"""The main job: examples/train_chars.py --quick trains 2 ranks with tandem DDP end to end."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

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
