"""Running a function as several ranks on threads of the test process."""

from __future__ import annotations

import threading
from typing import Any


def on_threads(n: int, work: Any) -> list[Any]:
    """``work(rank)`` for ranks 0..n-1, each on its own thread; the results (or errors)."""
    out: list[Any] = [None] * n

    def run(rank: int) -> None:
        try:
            out[rank] = work(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out
