"""c10d rendezvous: node ranks by join order, ``--nnodes MIN:MAX``, nodes joining and leaving.

::

    export TANDEM_SECRET=...    # the same on every node
    tandemrun --nnodes 2:4 --nproc-per-node 8 --rdzv-backend c10d \\
              --rdzv-endpoint node0:29400 --max-restarts 3 train.py    # on 2 to 4 nodes

The agent that can bind the endpoint hosts the store. A round closes as soon as MAX
nodes joined, or ``last_call_timeout`` seconds (``--rdzv-conf``, default 30; 0 when
MIN == MAX) after MIN had joined; ranks follow the join order and the node that joined
first hosts rank 0. A node that arrives after its round closed bumps the round's
``waiting`` counter and waits in the next round: if the running round has room (fewer
than MAX nodes), its agents stop their workers and everyone meets in the next round
(not counted as a restart). A node that leaves (its agent dies) makes the others'
workers fail; they meet in the next round without it, which closes once MIN nodes are
there. Round ``n+1`` never closes before a member of round ``n`` left it (``over``),
so a waiting node cannot start a second job beside the running one. Workers see the
new ``WORLD_SIZE`` and should resume from their checkpoint.
"""

from __future__ import annotations

import time

from tandem._words import secs
from tandem.errors import StoreTimeoutError
from tandem.run.config import LaunchConfig
from tandem.run.multinode import StoreRendezvous, gives_up

__all__ = ["DynamicRendezvous"]

POLL = 0.1  # seconds between looks at a round that is still open


class DynamicRendezvous(StoreRendezvous):
    """See the module docstring."""

    def __init__(self, cfg: LaunchConfig, secret: bytes) -> None:
        super().__init__(cfg, secret)
        default = 30.0 if cfg.min_nodes < cfg.max_nodes else 0.0
        self._last_call = cfg.conf("last_call_timeout", default)
        self._member_of: int | None = None  # the round whose workers we ran last

    def _latest(self) -> int:
        key = "tandemrun/latest"
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def _raise_latest(self, attempt: int) -> None:
        """Compare-and-set ``tandemrun/latest`` up to ``attempt`` (never down)."""
        key = "tandemrun/latest"
        current = b""
        while not current or int(current) < attempt:
            got = self.store.compare_set(key, current, str(attempt))
            if got == str(attempt).encode():
                return
            current = got

    def _join(self, attempt: int, restarts: int) -> tuple[int, int, int]:
        if self._member_of is not None:  # we leave our round: the next one may close
            self.store.set(self._key(self._member_of, "over"), b"1")
        attempt = max(attempt, self._latest())
        deadline = time.monotonic() + self._timeout
        while True:
            self._joining = attempt
            self._raise_latest(attempt)
            index = self.store.add(self._key(attempt, "order"), 1) - 1
            self.store.set(self._key(attempt, f"node/{index}"), self._info(restarts))
            size = self._await_close(attempt, deadline)
            if index < size:
                self._member_of = attempt
                return attempt, index, size
            # too late for this round: ask its members to make room, meet them in the next
            self.store.add(self._key(attempt, "waiting"), 1)
            attempt += 1

    def waiting(self, seconds: float) -> str:
        joined = self.store.add(self._key(self._joining, "order"), 0)
        return (f"still waiting for the other nodes after {seconds:.0f}s: {joined} joined "
                f"round {self._joining} of the rendezvous at {self._where_text()}, at least "
                f"{self._cfg.min_nodes} needed; {gives_up(self._timeout)}")

    def _await_close(self, attempt: int, deadline: float) -> int:
        """Close round ``attempt`` when its rules allow; return its size once closed."""
        lo, hi = self._cfg.min_nodes, self._cfg.max_nodes
        closed = self._key(attempt, "closed")
        since: float | None = None  # when we first saw MIN nodes
        while True:
            if self.store.check([closed]):
                return int(self.store.get(closed))
            count = self.store.add(self._key(attempt, "order"), 0)
            now = time.monotonic()
            ready = attempt == 0 or self.store.check([self._key(attempt - 1, "over")])
            want = 0
            if ready and count >= hi:
                want = hi
            elif ready and count >= lo:
                since = since if since is not None else now
                want = count if now - since >= self._last_call else 0
            if want:
                self.store.compare_set(closed, b"", str(want))
                continue
            if now >= deadline:
                raise StoreTimeoutError(
                    f"round {attempt} of the rendezvous at {self._where_text()} did not "
                    f"close within {secs(self._timeout)}s: {count} node(s) joined, at least "
                    f"{lo} needed (--rdzv-conf join_timeout=SECONDS)")
            time.sleep(POLL)

    def membership_changed(self, attempt: int) -> bool:
        return self._size < self._cfg.max_nodes and self.store.check(
            [self._key(attempt, "waiting")])
