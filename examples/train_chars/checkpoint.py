"""What the example's checkpoint holds, and when a run resumes from it.

The files are written and read by :mod:`tandem.checkpoint` (atomic: a rank killed
mid-save leaves the previous checkpoint intact). A run resumes from
``--out/checkpoint.pt``

* with ``--resume`` (the file must exist), or
* automatically when the launcher restarted the job (``TANDEM_RESTART_COUNT > 0``)
  and the file was written by this same job (its ``TANDEM_RUN_ID``), so that a stale
  checkpoint of an earlier job in the same ``--out`` is never mistaken for progress.

Rank 0 decides and tells the others; every rank then reads the file itself (the
ranks share a filesystem, as they do on one host).
"""

from __future__ import annotations

import os
from typing import Any

import torch

import tandem as dist
from tandem import checkpoint

__all__ = ["run_id", "resume_from", "load", "save"]


def run_id() -> str:
    """The launcher's job id (stable across its restarts); empty when run without it."""
    return os.environ.get("TANDEM_RUN_ID", "")


def _restart_count() -> int:
    try:
        return int(os.environ.get("TANDEM_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def _decide(path: str) -> tuple[bool, str]:
    """Rank 0's view of an automatic resume: (resume?, why)."""
    restarts = _restart_count()
    if restarts == 0 or not checkpoint.exists(path):
        return False, ""
    if not run_id() or checkpoint.load(path).get("run_id") != run_id():
        return False, f"restart {restarts}: {path} is from another job, starting over"
    return True, f"restart {restarts}"


def resume_from(path: str, resume: bool) -> tuple[bool, str]:
    """Whether this job continues from ``path`` (the same answer on every rank), and why."""
    if resume:  # every rank checks, so that every rank fails alike
        if not checkpoint.exists(path):
            raise FileNotFoundError(f"--resume: no checkpoint at {path}; "
                                    f"run once without --resume first")
        return True, "--resume"
    yes, why = _decide(path) if dist.get_rank() == 0 else (False, "")
    flag = torch.tensor([int(yes)], dtype=torch.uint8)
    dist.broadcast(flag, src=0)
    return bool(flag.item()), why


def load(path: str) -> dict[str, Any]:
    state: dict[str, Any] = checkpoint.load(path)
    return state


def save(state: dict[str, Any], path: str) -> None:
    """Every rank calls this; rank 0 writes ``state`` (tagged with the job id)."""
    checkpoint.save_on_rank0({**state, "run_id": run_id()}, path)
