"""Rank 0's progress: a tqdm bar on a terminal, plain periodic lines in logs and pipes."""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["Progress"]


class Progress:
    """``update(step, loss, samples_per_s)`` after each step; ``close()`` at the end.

    When stderr is not a terminal (logs, tests, a launcher's pipe) it prints a full line
    every tenth of the run instead of redrawing one: a bar redrawn with carriage returns
    is unreadable in a log file.
    """

    def __init__(self, total: int, initial: int = 0, enabled: bool = True) -> None:
        self.total, self.enabled = total, enabled
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.every = max(1, total // 10)
        self.bar: Any = None
        if enabled and self.tty:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, loss: float, samples_per_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{loss:.3f}", samples_s=f"{samples_per_s:.0f}")
            return
        line = (f"step {step:>5}/{self.total} | loss {loss:6.3f} | "
                f"{samples_per_s:7.1f} samples/s | {time.monotonic() - self.start:5.0f}s")
        if self.tty:
            sys.stderr.write("\r" + line)
        elif step % self.every == 0 or step == self.total:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
