"""Rendezvous: how the agents of a job agree, once per attempt, on ranks and a master.

The seam is :class:`Rendezvous`. :class:`LocalRendezvous` serves single-node jobs
without any store; :class:`tandem.run.multinode.StoreRendezvous` serves static and
c10d multi-node jobs through a TCPStore that the first node hosts.

Worker master ports are *reserved*, not merely probed: the agent keeps a socket bound
(``SO_REUSEADDR``, not listening) on the port for the whole attempt. Rank 0's store
can still listen there (it binds with ``SO_REUSEADDR`` too), while the kernel never
hands that port to another ``bind(port=0)`` -- so several jobs on one host never
collide, unlike probe-then-close.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from typing import Callable

from tandem import _wire
from tandem.errors import ArgumentError
from tandem.run.config import LaunchConfig
from tandem.run.rootcause import Failure
from tandem.store.base import Store

__all__ = ["Assignment", "Rendezvous", "LocalRendezvous", "StillWaiting", "reserve_port"]

NOTICE_AFTER = 30.0  # seconds a rendezvous step may block before the launcher says so


@dataclasses.dataclass(frozen=True)
class Assignment:
    """What one attempt's rendezvous decided for this node."""

    run_id: str
    attempt: int  # the round: numbers the store keys and the attempt_<n> log folders
    restart_count: int  # failures survived so far (membership changes do not count)
    node_rank: int
    nnodes: int
    rank_offset: int  # global rank of this node's local rank 0
    world_size: int
    role_rank_offset: int
    role_world_size: int
    master_addr: str
    master_port: int


def reserve_port(host: str, port: int = 0) -> socket.socket:
    """A socket bound to ``host:port`` (0: the kernel picks) that keeps the port ours."""
    try:
        sock = _wire.bind(host, port)
    except OSError as exc:
        what = f"port {port}" if port else "a free port"
        raise ArgumentError(f"cannot reserve {what} on {host} for MASTER_PORT: {exc}") from exc
    return sock


class StillWaiting:
    """While a rendezvous step blocks, say now and then that the launcher still waits.

    A node started alone (the others forgotten, or given a mistyped address) would
    otherwise print nothing until the join timeout, 600 s by default. ``say`` gets
    ``describe(seconds waited)`` after a quarter of ``timeout`` (at most
    :data:`NOTICE_AFTER` seconds), then at doubling intervals. It runs on a thread of
    its own, so the blocking call itself is not touched; use it as a context manager.
    """

    def __init__(self, say: Callable[[str], None], describe: Callable[[float], str],
                 timeout: float) -> None:
        self._say, self._describe = say, describe
        self._first, self._timeout = min(NOTICE_AFTER, timeout / 4), timeout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandemrun-waiting", daemon=True)

    def __enter__(self) -> "StillWaiting":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)  # a describe() still asking the store must not hold us

    def _run(self) -> None:
        start, after = time.monotonic(), self._first
        # none at the timeout itself: the step's own error says it then
        while after < self._timeout and not self._stop.wait(
                max(0.0, start + after - time.monotonic())):
            try:
                text = self._describe(time.monotonic() - start)
            except Exception as exc:  # the store itself may be what is missing
                text = f"still waiting for the rendezvous ({type(exc).__name__}: {exc})"
            if not self._stop.is_set():
                self._say(text)
            after *= 2


class Rendezvous:
    """Agreement between the agents of a job; a single node agrees with itself."""

    def next_round(self, attempt: int, restarts: int) -> Assignment:
        """Block until the nodes of round ``attempt`` (or a later one) joined; this node's share.

        ``restarts`` is how many failures this node has seen; the job's count is the
        highest among the nodes of the round.
        """
        raise NotImplementedError

    def waiting(self, seconds: float) -> str:
        """What :meth:`next_round` waits for, ``seconds`` into it (see :class:`StillWaiting`)."""
        return f"still waiting for the other nodes after {seconds:.0f}s"

    def membership_changed(self, attempt: int) -> bool:
        """Whether a new node waits to join and there is room: restart to admit it."""
        return False

    def publish_failure(self, attempt: int, failures: list[Failure]) -> None:
        """Tell the other nodes that ``attempt`` failed here, and how."""

    def remote_failed(self, attempt: int) -> bool:
        """Whether another node reported a failure in ``attempt``."""
        return False

    def remote_failures(self, attempt: int) -> list[Failure]:
        """The failures other nodes reported for ``attempt``."""
        return []

    def finish(self, attempt: int, interval: float, abort: Callable[[], bool]) -> bool:
        """After local success: True once every node succeeded, False if one failed."""
        return True

    def shared_store(self) -> tuple[Store, str] | None:
        """The store every node reaches and its ``host:port``, or None (one node)."""
        return None

    def close(self) -> None:
        """Leave the job; the node hosting the store waits (briefly) for the others."""


class LocalRendezvous(Rendezvous):
    """One node: ranks 0..nproc-1; MASTER_PORT reserved on ``master_addr`` per attempt.

    With ``--master-port P`` the workers get P on every attempt; otherwise each attempt
    gets a fresh free port, so no connection of a dead attempt can reach the new one.
    """

    def __init__(self, cfg: LaunchConfig, run_id: str) -> None:
        self._cfg = cfg
        self._run_id = run_id
        self._held: socket.socket | None = None

    def next_round(self, attempt: int, restarts: int) -> Assignment:
        cfg = self._cfg
        if self._held is None or not cfg.master_port:
            old, self._held = self._held, reserve_port(cfg.master_addr, cfg.master_port or 0)
            if old is not None:
                old.close()
        port = int(self._held.getsockname()[1])
        return Assignment(run_id=self._run_id, attempt=attempt, restart_count=restarts,
                          node_rank=0, nnodes=1,
                          rank_offset=0, world_size=cfg.nproc_per_node, role_rank_offset=0,
                          role_world_size=cfg.nproc_per_node, master_addr=cfg.master_addr,
                          master_port=port)

    def close(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True
