"""Worker output: rank-prefixed lines on the launcher's console, and per-rank log files.

Each worker stream is a pipe drained by one reader thread, so a chatty rank never
blocks on a full pipe and lines of different ranks never interleave mid-line::

    [rank0]: step 10 loss 0.31
    [rank1]: step 10 loss 0.29

With ``--log-dir`` every line also goes, unprefixed, to
``<log-dir>/<run_id>/attempt_<n>/rank_<r>/stdout.log`` (or ``stderr.log``).
"""

from __future__ import annotations

import sys
import threading
from typing import IO, Callable, TextIO

__all__ = ["Console", "start_pump"]


class Console:
    """One launcher stream (stdout or stderr) shared by every reader thread."""

    def __init__(self, get_stream: Callable[[], TextIO]) -> None:
        self._get_stream = get_stream  # looked up per write: tests may swap sys.stdout
        self._lock = threading.Lock()

    @classmethod
    def stdout(cls) -> Console:
        return cls(lambda: sys.stdout)

    @classmethod
    def stderr(cls) -> Console:
        return cls(lambda: sys.stderr)

    def write(self, prefix: str, line: bytes) -> None:
        text = line.decode("utf-8", errors="replace")
        if not text.endswith("\n"):
            text += "\n"
        with self._lock:
            stream = self._get_stream()
            try:
                stream.write(prefix + text)
                stream.flush()
            except (OSError, ValueError):
                pass  # the launcher's own stream is gone (closed pipe): keep draining

    def message(self, text: str) -> None:
        """A launcher line (not from a worker), kept whole among worker lines."""
        self.write("", text.encode())


def _drain(pipe: IO[bytes], prefix: str, console: Console | None, path: str | None) -> None:
    log = open(path, "wb") if path else None  # noqa: SIM115 - closed below
    try:
        for line in iter(pipe.readline, b""):
            if log is not None:
                log.write(line)
                log.flush()
            if console is not None:
                console.write(prefix, line)
    except (OSError, ValueError):
        pass  # the pipe was closed under us while stopping
    finally:
        if log is not None:
            log.close()
        pipe.close()


def start_pump(pipe: IO[bytes], prefix: str, console: Console | None,
               path: str | None, name: str) -> threading.Thread:
    """Start the daemon thread copying ``pipe`` line by line to ``console`` and ``path``."""
    thread = threading.Thread(target=_drain, args=(pipe, prefix, console, path),
                              name=name, daemon=True)
    thread.start()
    return thread
