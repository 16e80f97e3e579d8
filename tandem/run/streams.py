"""Worker output: rank-prefixed lines on the launcher's console, and per-rank log files.

Each worker stream is a pipe drained by one reader thread, so a chatty rank never
blocks on a full pipe and lines of different ranks never interleave mid-line::

    [rank0]: step 10 loss 0.31
    [rank0-3]: usage: train.py [-h] [--lr LR]      # printed alike by ranks 0 to 3

Identical lines that several ranks print at about the same time are shown once
(:mod:`tandem.run.dedup` says which and when; a line waits at most a second for its
twins, and a rank's own lines keep their order). On a terminal, carriage-return
redraws (progress bars) are passed through with the rank prefix: the bar redraws in
place, and lines of other ranks are printed above it. Workers are told, when their
stderr reaches a terminal this way (:func:`terminal_env`). Elsewhere only whole lines
are shown.

With ``--log-dir`` every byte also goes, unprefixed and at once, to
``<log-dir>/<run_id>/attempt_<n>/rank_<r>/stdout.log`` (or ``stderr.log``).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from typing import IO, Callable, TextIO

from tandem.run.dedup import Entry, Merger, rank_ranges

__all__ = ["Console", "start_pump", "terminal_env"]

MAX_LINE = 64 << 10  # a longer line without a newline is shown in pieces of this size
PREFIX_ROOM = len("[rank000]: ")
_BREAK = re.compile(rb"\r\n|\r|\n")


def terminal_env(stream: TextIO | None = None) -> dict[str, str]:
    """What a worker whose stderr reaches ``stream`` (default: our stderr) is told when
    that is a terminal: ``TANDEM_TTY=1`` (progress bars may redraw with carriage returns)
    and ``COLUMNS``, the terminal's width less the rank prefix. Empty otherwise."""
    stream = sys.stderr if stream is None else stream
    try:
        if not stream.isatty():
            return {}
        columns = os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return {}
    wanted = os.environ.get("COLUMNS", "")
    columns = int(wanted) if wanted.isdigit() else columns  # the user's choice first
    return {"TANDEM_TTY": "1", "COLUMNS": str(max(20, columns - PREFIX_ROOM))}


class Console:
    """One launcher stream (stdout or stderr) shared by every reader thread.

    Worker lines come in through :meth:`line` and :meth:`redraw`; the launcher's own
    through :meth:`message`. :meth:`close` shows what still waits and stops the timer
    thread that shows held lines when their time comes.
    """

    def __init__(self, get_stream: Callable[[], TextIO], merger: Merger | None = None) -> None:
        self._get_stream = get_stream  # looked up per write: tests may swap sys.stdout
        self._merger = merger or Merger()
        self._cond = threading.Condition()
        self._bar: tuple[int, str] | None = None  # (rank, text) of a redraw on screen
        self._timer: threading.Thread | None = None
        self._closed = False

    @classmethod
    def stdout(cls) -> Console:
        return cls(lambda: sys.stdout)

    @classmethod
    def stderr(cls) -> Console:
        return cls(lambda: sys.stderr)

    # -- input -----------------------------------------------------------------------
    def attach(self, rank: int) -> None:
        with self._cond:
            self._merger.attach(rank)

    def detach(self, rank: int) -> None:
        with self._cond:
            self._merger.detach(rank)
            self._show(self._merger.due(time.monotonic()))

    def line(self, rank: int, text: bytes) -> None:
        self._add(lambda now: self._merger.line(rank, _decode(text), now))

    def redraw(self, rank: int, text: bytes) -> None:
        self._add(lambda now: self._merger.redraw(rank, _decode(text), now))

    def message(self, text: str) -> None:
        """A launcher line (not from a worker): shown after everything that waits."""
        with self._cond:
            self._show(self._merger.drain(time.monotonic()))
            self._render(Entry(text, set(), False, 0.0))

    def _add(self, put: Callable[[float], None]) -> None:
        with self._cond:
            now = time.monotonic()
            put(now)
            if self._closed:  # no timer any more: nothing may wait
                self._show(self._merger.drain(now))
                return
            self._show(self._merger.due(now))
            if self._merger.next_due() is not None:
                if self._timer is None:
                    self._timer = threading.Thread(target=self._time, name="tandem-console",
                                                   daemon=True)
                    self._timer.start()
                self._cond.notify()

    def _time(self) -> None:
        """Show held lines when their time comes, until :meth:`close`."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                self._show(self._merger.due(now))
                due = self._merger.next_due()
                self._cond.wait(None if due is None else max(0.001, due - now))

    def close(self, timeout: float = 2.0) -> None:
        """Show whatever waits, end a redrawn line, stop the timer thread."""
        with self._cond:
            self._closed = True
            self._show(self._merger.drain(time.monotonic()))
            if self._bar is not None:
                self._write("\n")
                self._bar = None
            self._cond.notify()
        if self._timer is not None:
            self._timer.join(timeout)

    # -- output (the caller holds the lock) -------------------------------------------
    def _show(self, entries: list[Entry]) -> None:
        for entry in entries:
            self._render(entry)

    def _render(self, entry: Entry) -> None:
        prefix = f"[rank{rank_ranges(entry.ranks)}]: " if entry.ranks else ""
        text = prefix + entry.text
        terminal = self._is_terminal()
        if entry.redraw:
            if not terminal:
                return  # only whole lines belong in a file or a pipe
            (rank,) = entry.ranks
            width = 0
            if self._bar is not None and self._bar[0] != rank:
                self._write("\n")  # another rank's bar: leave it as a line
            elif self._bar is not None:
                width = len(self._bar[1])
            self._write("\r" + text + " " * max(0, width - len(text)))
            self._bar = (rank, text)
            return
        if self._bar is None or not terminal:
            self._write(text + "\n")
            return
        rank, bar = self._bar
        # the line goes where the bar is; the bar is drawn again below it unless the
        # line is the bar's rank finishing it (a bar's last state ends with a newline)
        self._write("\r" + text + " " * max(0, len(bar) - len(text)) + "\n")
        if rank in entry.ranks:
            self._bar = None
        else:
            self._write(bar)

    def _is_terminal(self) -> bool:
        try:
            return self._get_stream().isatty()
        except (OSError, ValueError, AttributeError):
            return False

    def _write(self, text: str) -> None:
        stream = self._get_stream()
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):
            pass  # the launcher's own stream is gone (closed pipe): keep draining


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _drain(pipe: IO[bytes], rank: int, console: Console | None, path: str | None) -> None:
    """Copy ``pipe`` to the log file as it comes, and to ``console`` as lines and redraws."""
    log = open(path, "wb") if path else None  # noqa: SIM115 - closed below
    part, shown = b"", b""  # the unfinished line, and its last redraw sent
    after_cr = False  # ``part`` follows a carriage return: the line is being redrawn
    fd = pipe.fileno()
    try:
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            if log is not None:
                log.write(chunk)
                log.flush()
            if console is None:
                continue
            data, start = part + chunk, 0
            for m in _BREAK.finditer(data):
                piece, start = data[start:m.start()], m.end()
                if m.group() == b"\r":
                    if piece and piece != shown:
                        console.redraw(rank, piece)
                    shown = piece if piece else shown
                    after_cr = True
                    continue
                if after_cr:  # what a terminal shows: the new text over the last redraw
                    piece += shown[len(piece):]
                console.line(rank, piece)
                shown, after_cr = b"", False
            part = data[start:]
            if after_cr and part and part != shown:
                console.redraw(rank, part)  # the bar's newest state, shown now
                shown = part
            elif len(part) >= MAX_LINE:
                console.line(rank, part)
                part = b""
    except (OSError, ValueError):
        pass  # the pipe was closed under us while stopping
    finally:
        if console is not None:
            if part or (after_cr and shown):
                console.line(rank, part + shown[len(part):] if after_cr else part)
            console.detach(rank)
        if log is not None:
            log.close()
        pipe.close()


def start_pump(pipe: IO[bytes], rank: int, console: Console | None,
               path: str | None, name: str) -> threading.Thread:
    """Start the daemon thread copying ``pipe`` to ``console`` (as rank ``rank``) and
    to the file ``path``."""
    if console is not None:
        console.attach(rank)
    thread = threading.Thread(target=_drain, args=(pipe, rank, console, path),
                              name=name, daemon=True)
    thread.start()
    return thread
