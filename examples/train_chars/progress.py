"""Rank 0's progress: a tqdm bar on a terminal, plain periodic lines in logs and pipes.

Under ``tandemrun`` a worker's stderr is a pipe to the launcher, which says in
``TANDEM_TTY=1`` when its own console is a terminal: it then passes the bar's
carriage-return redraws through with the rank prefix, and ``COLUMNS`` is the width
left after that prefix.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any

__all__ = ["Progress", "on_a_terminal"]


def on_a_terminal() -> bool:
    """Whether what this process writes to stderr ends up on a terminal."""
    return sys.stderr.isatty() or os.environ.get("TANDEM_TTY") == "1"


class Progress:
    """``update(step, loss, samples_per_s)`` after each step; ``close()`` at the end.

    When stderr does not reach a terminal (logs, tests, a pipe) it prints a full line
    every tenth of the run instead of redrawing one: a bar redrawn with carriage
    returns is unreadable in a log file.
    """

    def __init__(self, total: int, initial: int = 0, enabled: bool = True) -> None:
        self.total, self.enabled = total, enabled
        self.start = time.monotonic()
        self.tty = on_a_terminal()
        self.every = max(1, total // 10)
        self.bar: Any = None
        if enabled and self.tty:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                direct = sys.stderr.isatty()  # else tqdm cannot ask the pipe for a width
                self.bar = tqdm(total=total, initial=initial, unit="step", file=sys.stderr,
                                dynamic_ncols=direct,
                                ncols=None if direct else shutil.get_terminal_size().columns)

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
