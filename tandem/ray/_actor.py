"""One rank's Ray actor: says where it landed, runs the training function, keeps its output.

The driver makes it a Ray actor (``ray.remote(RankActor)``) with room for calls to run
at once, so that :meth:`RankActor.output` answers while :meth:`RankActor.run` trains.
While the function runs, file descriptors 1 and 2 go to pipes that this actor reads
line by line: the driver fetches the lines and prints them with the rank's prefix
(Ray's own log forwarding would merge identical lines of different ranks into one).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Any, Callable, Mapping

__all__ = ["RankActor", "MAX_KEPT_LINES"]

MAX_KEPT_LINES = 100_000  # lines waiting for the driver; older ones are dropped past this
_LINE_CAP = 64 * 1024  # a "line" longer than this is cut into pieces


class RankActor:
    """See the module docstring; methods are called by :class:`~tandem.ray.Trainer`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lines: list[tuple[str, str]] = []  # (stream, text), in arrival order
        self._base = 0  # index of self._lines[0] among every line ever kept
        self._dropped = 0

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

    def output(self, start: int) -> tuple[int, list[tuple[str, str]], int]:
        """Lines from index ``start`` on: (next start, lines, lines dropped so far)."""
        with self._lock:
            skip = max(start - self._base, 0)
            lines = self._lines[skip:]
            return self._base + len(self._lines), lines, self._dropped

    def _keep(self, stream: str, text: str) -> None:
        with self._lock:
            self._lines.append((stream, text))
            if len(self._lines) > MAX_KEPT_LINES:  # the driver stopped reading: bound it
                cut = len(self._lines) - MAX_KEPT_LINES
                del self._lines[:cut]
                self._base += cut
                self._dropped += cut

    def _reader(self, fd: int, stream: str) -> None:
        pending = b""
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while True:
                chunk = pipe.read(65536)
                if not chunk:
                    break
                pending += chunk
                while b"\n" in pending or len(pending) > _LINE_CAP:
                    cut = pending.find(b"\n")
                    cut = _LINE_CAP if cut < 0 or cut > _LINE_CAP else cut
                    self._keep(stream, pending[:cut].decode(errors="replace"))
                    pending = pending[cut + 1:] if pending[cut:cut + 1] == b"\n" \
                        else pending[cut:]
        if pending:
            self._keep(stream, pending.decode(errors="replace"))

    def run(self, fn: Callable[..., Any], config: Mapping[str, Any] | None,
            env: Mapping[str, str]) -> Any:
        """Run ``fn(config)`` (or ``fn()`` without a config) with ``env`` set; its result."""
        os.environ.update(env)
        readers = []
        saved = []
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            read_end, write_end = os.pipe()
            getattr(sys, stream).flush()
            saved.append(os.dup(fd))
            os.dup2(write_end, fd)
            os.close(write_end)
            t = threading.Thread(target=self._reader, args=(read_end, stream),
                                 name=f"tandem-ray-{stream}", daemon=True)
            t.start()
            readers.append(t)
        for out in (sys.stdout, sys.stderr):  # a line reaches the driver when it ends
            reconfigure = getattr(out, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(line_buffering=True)
        try:
            return fn(config) if config is not None else fn()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)  # closes the pipe's last write end: its reader sees EOF
                os.close(old)
            for t in readers:
                t.join(10.0)
