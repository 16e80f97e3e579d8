"""Connected transports in one process, for the in-process transport tests.

All ranks must connect at once (each waits for the others in the store), so each is
built on a thread of its own; ``connected_pair`` returns them once all exist.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

from tandem.store.hash import HashStore

T = TypeVar("T")


def connected_pair(make: Callable[[int, HashStore], T], kind: type, n: int = 2) -> list[T]:
    """``[make(0, store), ..., make(n - 1, store)]`` built concurrently on one fresh store;
    each must be an instance of ``kind`` within 60 s."""
    store = HashStore()
    made: list[Any] = [None] * n

    def build(rank: int) -> None:
        made[rank] = make(rank, store)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(m, kind) for m in made), made
    return made
