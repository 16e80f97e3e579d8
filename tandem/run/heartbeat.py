"""Agent liveness for multi-node jobs: a counter each agent bumps, and a watch on the others.

An agent that dies (SIGKILL, lost machine) takes its workers with it, but the other
nodes' workers may not notice for a long time: they can be importing torch, or
still retrying to connect to a rank-0 store that will never come up. So every agent
bumps ``tandemrun/alive/<agent id>`` every ``keep_alive_interval`` seconds
(``--rdzv-conf``, default 1), and a peer whose counter has not moved for
``keep_alive_max_attempt`` intervals (default 5) is declared lost: its round fails
and the survivors restart. Counters, not timestamps, so node clocks need not agree.
"""

from __future__ import annotations

import threading
import time

from tandem.errors import TandemError
from tandem.store.base import Store

__all__ = ["Heartbeat", "Watch", "alive_key"]


def alive_key(agent: str) -> str:
    return f"tandemrun/alive/{agent}"


class Heartbeat:
    """Bumps this agent's counter from a daemon thread until :meth:`stop`."""

    def __init__(self, store: Store, agent: str, interval: float) -> None:
        self._store, self._key, self._interval = store, alive_key(agent), interval
        self._stop = threading.Event()
        store.add(self._key, 1)  # visible before anyone can watch it
        self._thread = threading.Thread(target=self._run, name="tandem-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._store.add(self._key, 1)
            except TandemError:
                return  # the store is gone; the agent's own calls will say so

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


class Watch:
    """Tells which watched agents stopped bumping their counters."""

    def __init__(self, store: Store, interval: float, misses: int) -> None:
        self._store, self._interval, self._limit = store, interval, interval * misses
        self._seen: dict[str, tuple[int, float]] = {}  # agent -> (counter, when it moved)
        self._next = 0.0

    def reset(self) -> None:
        """Forget what was seen (a new round: start every peer's grace period afresh)."""
        self._seen.clear()

    def lost(self, agents: list[str]) -> list[str]:
        """The agents whose counter has not moved for too long; checks once per interval."""
        now = time.monotonic()
        if now < self._next:
            return []
        self._next = now + self._interval
        out = []
        for agent in agents:
            count = self._store.add(alive_key(agent), 0)
            last = self._seen.get(agent)
            if last is None or count != last[0]:
                self._seen[agent] = (count, now)
            elif now - last[1] > self._limit:
                out.append(agent)
        return out
