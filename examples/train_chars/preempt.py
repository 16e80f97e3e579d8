"""Stop at a preemption warning: checkpoint, say so, exit cleanly, resume later.

A scheduler warns a job before it takes the nodes away: SLURM sends SIGUSR1 to every
task ``SECONDS`` before the time limit with ``--signal=USR1@SECONDS`` (tandemrun
forwards it to its workers). The signal reaches the ranks at different steps, so each
step the ranks agree on whether any got it (one all-reduce, shared with the loss's);
then every rank stops after the same step, the checkpoint is written, and rank 0
leaves ``preempted.json`` in the run's directory. A batch script that finds it
requeues the job (``scontrol requeue $SLURM_JOB_ID``), which continues with
``--resume`` (``examples/slurm/requeue.sbatch``).
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import torch

import tandem as dist

__all__ = ["Preemption", "MARKER"]

MARKER = "preempted.json"


class Preemption:
    """Notes SIGUSR1 (installed on construction); :meth:`mean_loss_and_stop` agrees on it."""

    def __init__(self) -> None:
        self.asked = False
        signal.signal(signal.SIGUSR1, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        self.asked = True  # acted on at the end of the step, when every rank agrees

    def mean_loss_and_stop(self, loss: torch.Tensor) -> tuple[float, bool]:
        """The loss averaged over the ranks, and whether any rank was warned."""
        buf = torch.tensor([float(loss.detach()), 1.0 if self.asked else 0.0],
                           dtype=torch.float64)
        dist.all_reduce(buf)
        return float(buf[0]) / dist.get_world_size(), bool(buf[1] > 0)

    @staticmethod
    def leave_note(run_dir: str, step: int, steps: int) -> None:
        """Rank 0: record the stop where the batch script looks, and say it."""
        with open(os.path.join(run_dir, MARKER), "w", encoding="utf-8") as f:
            json.dump({"step": step, "steps": steps}, f)
        print(f"train_chars: preempted (SIGUSR1) after step {step} of {steps}: checkpoint "
              f"saved; continue with --resume (--out {run_dir})", flush=True)

    @staticmethod
    def clear_note(run_dir: str) -> None:
        """A run that continues a preempted one removes the earlier note."""
        path = os.path.join(run_dir, MARKER)
        if os.path.exists(path):
            os.remove(path)
