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
from typing import IO, Callable, Sequence, TextIO

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


class _Screen:
    """What the launcher's two streams share: one merger (so that lines held on one
    stream are not overtaken by the other's), one lock, the redrawn line on screen (both
    streams are the same terminal when both are terminals), and the timer thread that
    shows held lines when their time comes, until :meth:`close`."""

    def __init__(self, streams: dict[str, Callable[[], TextIO]], merger: Merger) -> None:
        self.streams = streams  # looked up per write: tests may swap sys.stdout
        self.merger = merger
        self.cond = threading.Condition()
        self.bar: tuple[str, int, str] | None = None  # (stream, rank, text) on screen
        self.timer: threading.Thread | None = None
        self.closed = False
        # workers shown by a name of their own (tandem.elastic's replacements and spares,
        # ``[rank1.1]``, ``[spare0.0]``), under keys below 0 that no rank has
        self.labels: dict[int, str] = {}

    def add(self, put: Callable[[float], None]) -> None:
        with self.cond:
            now = time.monotonic()
            put(now)
            if self.closed:  # no timer any more: nothing may wait
                self.show(self.merger.drain(now))
                return
            self.show(self.merger.due(now))
            if self.merger.next_due() is not None:
                if self.timer is None:
                    self.timer = threading.Thread(target=self._time, name="tandem-console",
                                                  daemon=True)
                    self.timer.start()
                self.cond.notify()

    def _time(self) -> None:
        with self.cond:
            while not self.closed:
                now = time.monotonic()
                self.show(self.merger.due(now))
                due = self.merger.next_due()
                self.cond.wait(None if due is None else max(0.001, due - now))

    def close(self, timeout: float) -> None:
        with self.cond:
            self.closed = True
            self.show(self.merger.drain(time.monotonic()))
            if self.bar is not None:
                self._write(self.bar[0], "\n")
                self.bar = None
            self.cond.notify()
        if self.timer is not None:
            self.timer.join(timeout)

    # -- output (the caller holds the lock) -------------------------------------------
    def show(self, entries: list[Entry]) -> None:
        for entry in entries:
            self.render(entry)

    def _prefix(self, ranks: set[int]) -> str:
        plain = {r for r in ranks if r not in self.labels}
        names = [f"rank{rank_ranges(plain)}"] if plain else []
        names += sorted(self.labels[r] for r in ranks if r in self.labels)
        return f"[{','.join(names)}]: " if names else ""

    def render(self, entry: Entry) -> None:
        prefix = self._prefix(entry.ranks)
        text = prefix + entry.text
        terminal = self._is_terminal(entry.stream)
        if entry.redraw:
            if not terminal:
                return  # only whole lines belong in a file or a pipe
            (rank,) = entry.ranks
            width = 0
            if self.bar is not None and self.bar[:2] != (entry.stream, rank):
                self._write(self.bar[0], "\n")  # another rank's bar: leave it as a line
            elif self.bar is not None:
                width = len(self.bar[2])
            self._write(entry.stream, "\r" + text + " " * max(0, width - len(text)))
            self.bar = (entry.stream, rank, text)
            return
        if self.bar is None or not terminal:
            self._write(entry.stream, text + "\n")
            return
        stream, rank, bar = self.bar
        # the line goes where the bar is; the bar is drawn again below it unless the
        # line is the bar's rank finishing it (a bar's last state ends with a newline)
        self._write(entry.stream, "\r" + text + " " * max(0, len(bar) - len(text)) + "\n")
        if stream == entry.stream and rank in entry.ranks:
            self.bar = None
        else:
            self._write(stream, bar)

    def _is_terminal(self, stream: str) -> bool:
        try:
            return self.streams[stream]().isatty()
        except (OSError, ValueError, AttributeError):
            return False

    def _write(self, stream: str, text: str) -> None:
        out = self.streams[stream]()
        try:
            out.write(text)
            out.flush()
        except (OSError, ValueError):
            pass  # the launcher's own stream is gone (closed pipe): keep draining


class Console:
    """One of the launcher's streams, shared by every reader thread; see the module
    docstring. ``out, err = Console.pair()`` makes the two, which share one screen.

    Worker lines come in through :meth:`line` and :meth:`redraw`; the launcher's own
    through :meth:`message`. :meth:`close` (of either) shows what still waits and stops
    the timer thread.
    """

    def __init__(self, screen: _Screen, stream: str) -> None:
        self._screen = screen
        self.stream = stream

    @classmethod
    def pair(cls, out: Callable[[], TextIO] = lambda: sys.stdout,
             err: Callable[[], TextIO] = lambda: sys.stderr,
             merger: Merger | None = None) -> tuple[Console, Console]:
        screen = _Screen({"stdout": out, "stderr": err}, merger or Merger())
        return cls(screen, "stdout"), cls(screen, "stderr")

    def labelled(self, label: str) -> int:
        """A key for a worker shown as ``[label]`` rather than by its rank (both streams
        of a pair share it)."""
        with self._screen.cond:
            key = -1 - len(self._screen.labels)
            self._screen.labels[key] = label
            return key

    def relabel(self, key: int, label: str) -> None:
        """Show the worker under ``key`` as ``[label]`` from now on."""
        with self._screen.cond:
            self._screen.labels[key] = label

    def attach(self, rank: int) -> None:
        with self._screen.cond:
            self._screen.merger.attach(rank, self.stream)

    def detach(self, rank: int) -> None:
        screen = self._screen
        with screen.cond:
            screen.merger.detach(rank, self.stream)
            screen.show(screen.merger.due(time.monotonic()))

    def line(self, rank: int, text: bytes) -> None:
        self.read(rank, [(text, False)])

    def redraw(self, rank: int, text: bytes) -> None:
        self.read(rank, [(text, True)])

    def read(self, rank: int, pieces: Sequence[tuple[bytes, bool]]) -> None:
        """What one read of ``rank``'s pipe brought: (text, is a redraw) in order. They
        are handed over at once, at one time, so that they count as one write
        (:data:`tandem.run.dedup.BURST`) however slowly a loaded machine runs the reader:
        a traceback that shares its first line with another rank's stays whole."""
        merger = self._screen.merger

        def put(now: float) -> None:
            for text, redraw in pieces:
                (merger.redraw if redraw else merger.line)(rank, self.stream,
                                                           _decode(text), now)
        if pieces:
            self._screen.add(put)

    def message(self, text: str) -> None:
        """A launcher line (not from a worker): shown after everything that waits."""
        screen = self._screen
        with screen.cond:
            screen.show(screen.merger.drain(time.monotonic()))
            screen.render(Entry(self.stream, text, set(), False, 0.0))

    def close(self, timeout: float = 2.0) -> None:
        """Show whatever waits, end a redrawn line, stop the timer thread (idempotent)."""
        self._screen.close(timeout)


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
            pieces: list[tuple[bytes, bool]] = []  # (text, is a redraw), handed over at once
            for m in _BREAK.finditer(data):
                piece, start = data[start:m.start()], m.end()
                if m.group() == b"\r":
                    if piece and piece != shown:
                        pieces.append((piece, True))
                    shown = piece if piece else shown
                    after_cr = True
                    continue
                if after_cr:  # what a terminal shows: the new text over the last redraw
                    piece += shown[len(piece):]
                pieces.append((piece, False))
                shown, after_cr = b"", False
            part = data[start:]
            if after_cr and part and part != shown:
                pieces.append((part, True))  # the bar's newest state, shown now
                shown = part
            elif len(part) >= MAX_LINE:
                pieces.append((part, False))
                part = b""
            console.read(rank, pieces)
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
