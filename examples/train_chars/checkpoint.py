"""Checkpoints written atomically: a crash mid-save leaves the previous file intact."""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["save_atomic", "load_checkpoint"]


def save_atomic(state: dict[str, Any], path: str) -> None:
    """``torch.save`` to a temporary file in the same directory, fsync, then ``os.replace``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_checkpoint(path: str) -> dict[str, Any]:
    """Load a checkpoint of plain tensors and containers (``weights_only``: nothing executes)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}; run once without --resume first")
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state
