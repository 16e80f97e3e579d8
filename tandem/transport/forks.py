"""What a forked child does with its parent's transports: it lets go of them.

A child made by ``fork`` (a DataLoader worker, say) inherits every connection. If
it kept them open, peers would not see the parent's death until their deadline.
So the child closes its copies (the parent's connections stay up). The process
registers one hook with the interpreter, once; transports enter and leave a
registry, so a closed transport leaves no hook behind::

    forks.track(transport)     # at the end of the transport's set-up
    forks.untrack(transport)   # in its close()
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Protocol

__all__ = ["track", "untrack", "tracked"]


class Forgettable(Protocol):
    def forget_in_child(self) -> None: ...


_live: "weakref.WeakSet[Forgettable]" = weakref.WeakSet()
_lock = threading.Lock()
_hooked = False


def _after_fork_in_child() -> None:
    for t in list(_live):
        t.forget_in_child()
    _live.clear()


def track(transport: Forgettable) -> None:
    """Have a forked child drop ``transport``'s connections."""
    global _hooked
    with _lock:
        if not _hooked:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _hooked = True
        _live.add(transport)


def untrack(transport: Forgettable) -> None:
    _live.discard(transport)


def tracked() -> int:
    """How many transports a fork would act on now."""
    return len(_live)
