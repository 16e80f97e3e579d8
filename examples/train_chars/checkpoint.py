"""Where a run writes, what its checkpoint holds, and when a run resumes from it.

A run never overwrites another run's checkpoint:

* without ``--out``, each run gets a new directory, ``runs/train_chars/run_001``,
  ``run_002``, ...; ``--resume`` continues the latest one that has a checkpoint;
* with ``--out DIR`` the run writes to DIR; if DIR already holds a checkpoint, the run
  continues it with ``--resume`` and is refused without (remove it, or pick another DIR);
* when the launcher restarts the job after a failure (``TANDEM_RESTART_COUNT > 0``),
  the ranks continue their own job's directory and checkpoint (``TANDEM_RUN_ID``,
  noted in the directory's ``run.json`` and in the checkpoint), never an earlier job's.

Rank 0 decides and tells the others; every rank then reads the checkpoint itself (the
ranks share a filesystem, as they do on one host). Files are written and read by
:mod:`tandem.checkpoint` (atomic: a rank killed mid-save leaves the previous
checkpoint intact).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from typing import Any

import tandem as dist
from tandem import checkpoint

__all__ = ["RUNS", "Run", "choose_run", "agree_on_run", "load", "save"]

RUNS = os.path.join("runs", "train_chars")  # where numbered run directories go
_NUMBERED = re.compile(r"run_(\d+)$")


@dataclasses.dataclass(frozen=True)
class Run:
    """Where this run writes, and whether (and why) it continues a checkpoint there."""

    out: str
    resume: bool
    why: str = ""

    @property
    def checkpoint(self) -> str:
        return os.path.join(self.out, "checkpoint.pt")


def run_id() -> str:
    """The launcher's job id (stable across its restarts); empty when run without it."""
    return os.environ.get("TANDEM_RUN_ID", "")


def _restart_count() -> int:
    try:
        return int(os.environ.get("TANDEM_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def _numbered(root: str) -> list[tuple[int, str]]:
    """The run directories under ``root``, oldest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in names if (m := _NUMBERED.match(n))]
    return sorted(found)


def _job_of(directory: str) -> str:
    try:
        with open(os.path.join(directory, "run.json"), encoding="utf-8") as f:
            return str(json.load(f).get("run_id", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def _new_run_dir(root: str) -> str:
    """Create the next numbered run directory (another run may be creating one too)."""
    os.makedirs(root, exist_ok=True)
    number = max((n for n, _ in _numbered(root)), default=0) + 1
    while True:
        path = os.path.join(root, f"run_{number:03d}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            number += 1


def _note_run(directory: str) -> None:
    with open(os.path.join(directory, "run.json"), "w", encoding="utf-8") as f:
        json.dump({"run_id": run_id(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "argv": sys.argv}, f)


def _restarted(path: str) -> tuple[bool, str]:
    """After a launcher restart: continue ``path`` if this job wrote it."""
    restarts = _restart_count()
    if not checkpoint.exists(path):
        return False, f"restart {restarts}: no checkpoint yet, starting over"
    if not run_id() or checkpoint.load(path).get("run_id") != run_id():
        raise SystemExit(f"train_chars: restart {restarts}: {path} is from another job")
    return True, f"restart {restarts}"


def choose_run(out: str | None, resume: bool) -> Run:
    """Rank 0's decision (it may create the run's directory); SystemExit with a message
    when the flags ask for something that is not there, or would overwrite a run."""
    if out is None:
        runs = _numbered(RUNS)
        if resume:
            done = [d for _, d in runs if checkpoint.exists(os.path.join(d, "checkpoint.pt"))]
            if not done:
                raise SystemExit(f"train_chars: --resume: no run with a checkpoint under "
                                 f"{RUNS}; run once without --resume first")
            return Run(done[-1], True, "--resume")
        if _restart_count() and run_id():
            mine = [d for _, d in runs if _job_of(d) == run_id()]
            if mine:
                return Run(mine[-1], *_restarted(os.path.join(mine[-1], "checkpoint.pt")))
        out = _new_run_dir(RUNS)
        _note_run(out)
        return Run(out, False)
    path = os.path.join(out, "checkpoint.pt")
    if resume:
        if not checkpoint.exists(path):
            raise SystemExit(f"train_chars: --resume: no checkpoint at {path}; "
                             f"run once without --resume first")
        return Run(out, True, "--resume")
    if _restart_count():
        return Run(out, *_restarted(path))
    if checkpoint.exists(path):
        step = checkpoint.load(path).get("step", "?")
        raise SystemExit(f"train_chars: {out} holds the checkpoint of an earlier run "
                         f"(step {step}); --resume continues it, and a new run needs "
                         f"another --out (or none: each run then gets runs/train_chars/run_NNN)")
    os.makedirs(out, exist_ok=True)
    _note_run(out)
    return Run(out, False)


def agree_on_run(out: str | None, resume: bool) -> Run:
    """Every rank calls this: rank 0 chooses, the others learn its choice (or its refusal,
    which every rank then exits with; rank 0 alone prints it)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = choose_run(out, resume)
        except SystemExit as refusal:
            box[0] = str(refusal.code)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):  # rank 0 says why; the others only fail with it
        raise SystemExit(box[0] if dist.get_rank() == 0 else 1)
    run: Run = box[0]
    return run


def load(path: str) -> dict[str, Any]:
    state: dict[str, Any] = checkpoint.load(path)
    return state


def save(state: dict[str, Any], path: str) -> None:
    """Every rank calls this; rank 0 writes ``state`` (tagged with the job id)."""
    checkpoint.save_on_rank0({**state, "run_id": run_id()}, path)
