"""One rank's Ray actor, and the sink its output goes to on the way to the driver.

:class:`RankActor` runs the training function in its process's main thread, as a
rank started by a launcher would (a handler for SIGUSR1, the preemption warning, can
only be installed there); so it serves one call at a time. While the function runs,
file descriptors 1 and 2 go to pipes that the actor reads line by line
(:func:`capture_output`), and a pump thread pushes the lines to an :class:`OutputSink`
actor every 0.1 s, where the driver takes them and prints them with the rank's prefix.
Ray's own log forwarding would need no sink, but it folds identical lines of different
ranks into one and prefixes a pid, not a rank.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Any, Callable, Mapping, TypeVar

__all__ = ["RankActor", "OutputSink", "capture_output", "MAX_KEPT_LINES"]

T = TypeVar("T")
Line = tuple[str, str]  # (stream, text)

MAX_KEPT_LINES = 100_000  # lines waiting for the driver; older ones are dropped past this
_LINE_CAP = 64 * 1024  # a "line" longer than this is cut into pieces
_PUMP_S = 0.1  # how often captured lines are pushed to the sink
_FINAL_PUSH_S = 30.0  # how long the last lines may take to reach the sink


class OutputSink:
    """Every rank's lines, kept until the driver takes them (bounded)."""

    def __init__(self) -> None:
        self._lines: list[tuple[str, str, str]] = []  # (key, stream, text)
        self.dropped = 0

    def put(self, key: str, lines: list[Line]) -> None:
        self._lines += [(key, stream, text) for stream, text in lines]
        if len(self._lines) > MAX_KEPT_LINES:  # the driver stopped reading: bound it
            cut = len(self._lines) - MAX_KEPT_LINES
            del self._lines[:cut]
            self.dropped += cut

    def take(self) -> tuple[list[tuple[str, str, str]], int]:
        """The lines kept since the last call, and how many were dropped in all."""
        lines, self._lines = self._lines, []
        return lines, self.dropped


def _read_lines(fd: int, stream: str, keep: Callable[[Line], None]) -> None:
    pending = b""
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while True:
            chunk = pipe.read(65536)
            if not chunk:
                break
            pending += chunk
            while b"\n" in pending or len(pending) > _LINE_CAP:
                cut = pending.find(b"\n")
                if 0 <= cut <= _LINE_CAP:
                    keep((stream, pending[:cut].decode(errors="replace")))
                    pending = pending[cut + 1:]
                else:
                    keep((stream, pending[:_LINE_CAP].decode(errors="replace")))
                    pending = pending[_LINE_CAP:]
    if pending:
        keep((stream, pending.decode(errors="replace")))


def capture_output(fn: Callable[[], T], push: Callable[[list[Line]], Any],
                   settle: Callable[[Any], Any]) -> T:
    """``fn()`` with file descriptors 1 and 2 captured line by line: ``push(lines)`` gets
    them every 0.1 s and at the end, whose result ``settle`` waits for."""
    lock = threading.Lock()
    pending: list[Line] = []
    done = threading.Event()

    def keep(line: Line) -> None:
        with lock:
            pending.append(line)

    def take() -> list[Line]:
        with lock:
            lines = pending[:]
            pending.clear()
            return lines

    def pump() -> None:
        while not done.wait(_PUMP_S):
            lines = take()
            if lines:
                push(lines)

    readers, saved = [], []
    for fd, name in ((1, "stdout"), (2, "stderr")):
        read_end, write_end = os.pipe()
        getattr(sys, name).flush()
        saved.append(os.dup(fd))
        os.dup2(write_end, fd)
        os.close(write_end)
        t = threading.Thread(target=_read_lines, args=(read_end, name, keep),
                             name=f"tandem-ray-{name}", daemon=True)
        t.start()
        readers.append(t)
    for out in (sys.stdout, sys.stderr):  # a line reaches the driver when it ends
        reconfigure = getattr(out, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    pumper = threading.Thread(target=pump, name="tandem-ray-pump", daemon=True)
    pumper.start()
    try:
        return fn()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)  # closes the pipe's last write end: its reader sees EOF
            os.close(old)
        for t in readers:
            t.join(10.0)
        done.set()
        pumper.join(10.0)
        lines = take()
        if lines:
            settle(push(lines))


class RankActor:
    """See the module docstring; methods are called by :class:`~tandem.ray.Trainer`.
    ``sink``: the :class:`OutputSink` actor; ``key``: this actor's lines' key there."""

    def __init__(self, sink: Any, key: str) -> None:
        self._sink, self._key = sink, key

    def where(self) -> tuple[str, str, str, int]:
        """(Ray node id, the node's address, host name, pid)."""
        import ray

        return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
                socket.gethostname(), os.getpid())

    def free_port(self) -> int:
        """A TCP port free on this node now (rank 0's store listens there)."""
        import ray

        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return int(s.getsockname()[1])

    def run(self, fn: Callable[..., Any], config: Mapping[str, Any] | None,
            env: Mapping[str, str]) -> Any:
        """Run ``fn(config)`` (or ``fn()`` without a config) with ``env`` set; its result."""
        import ray

        os.environ.update(env)
        return capture_output(lambda: fn(config) if config is not None else fn(),
                              lambda lines: self._sink.put.remote(self._key, lines),
                              lambda ref: ray.get(ref, timeout=_FINAL_PUSH_S))
