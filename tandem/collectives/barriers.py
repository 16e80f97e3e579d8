"""barrier and monitored_barrier: wait until every rank of a group has arrived.

``barrier`` is an all-reduce of one byte: a post of each rank in the shared staging
memory (nothing staged) on a group whose ranks share memory; across hosts, each host's
ranks check in with their leader and the leaders meet (``algorithms.leaders_barrier``);
else by recursive doubling (``log2 p`` rounds).
``monitored_barrier`` gathers arrivals at group rank 0, so when a rank is missing it can
say which: the error names every rank that did not arrive within the timeout.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch

from tandem._words import secs
from tandem.collectives import algorithms as algo
from tandem.collectives import api
from tandem.collectives.group import Op, as_bytes
from tandem.collectives.reduce_op import ReduceOp
from tandem.collectives.work import Work
from tandem.collectives.world import AnyGroup, resolve_group
from tandem.config import timeout_seconds
from tandem.errors import ArgumentError, CollectiveTimeoutError

__all__ = ["barrier", "monitored_barrier"]

_UNREAD = torch.zeros(1, dtype=torch.uint8)  # the token of barriers that read none


def barrier(group: AnyGroup | None = None, async_op: bool = False,
            device_ids: Any = None, timeout: float | datetime.timedelta | None = None) -> Work | None:
    """Return once every rank of the group has entered the barrier (``timeout``: this call's
    deadline instead of the group's)."""
    g = resolve_group(group, "barrier")
    if device_ids is not None:
        raise ArgumentError(f"barrier: device_ids={device_ids!r}: tandem moves CPU tensors and "
                            f"binds no devices; call barrier() without device_ids")
    seconds = None if timeout is None else timeout_seconds(timeout, g.timeout, "barrier: timeout")
    name, fn = algo.select_barrier(g)
    # the arena's barrier reads no token, so makes none (a forked rank's first tensor is
    # costly); the others reduce a byte of their own in place
    token = _UNREAD if name == "shm" else torch.zeros(1, dtype=torch.uint8)

    def body(o: Op) -> None:
        if seconds is not None:
            o.deadline = time.monotonic() + seconds
        fn(o, token, ReduceOp.MAX)

    return api._launch(g, "barrier", "barrier", body, async_op, None)


def monitored_barrier(group: AnyGroup | None = None,
                      timeout: float | datetime.timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive within ``timeout``.

    Rank 0 of the group collects an arrival from every other rank, then releases
    them. With ``wait_all_ranks`` it waits the full timeout and names every missing
    rank; otherwise it reports the first one it runs out of time on.
    """
    g = resolve_group(group, "monitored_barrier")
    seconds = timeout_seconds(timeout, g.timeout, "monitored_barrier: timeout")
    if not isinstance(wait_all_ranks, bool):  # "no" would be true
        raise ArgumentError(f"monitored_barrier: wait_all_ranks must be a bool, got "
                            f"{type(wait_all_ranks).__name__} {wait_all_ranks!r}")
    token = torch.zeros(1, dtype=torch.uint8)

    def body(o: Op) -> None:
        o.deadline = time.monotonic() + seconds
        if g.group_rank != 0:
            o.wait(o.send(0, 0, as_bytes(token)))
            o.wait(o.recv(0, 1, as_bytes(torch.zeros(1, dtype=torch.uint8))))
            return
        slots = [o.recv(i, 0, as_bytes(torch.zeros(1, dtype=torch.uint8)))
                 for i in range(1, g.group_size)]
        missing = []
        for i, slot in enumerate(slots, start=1):
            try:
                o.wait(slot)
            except CollectiveTimeoutError:
                missing.append(g.ranks[i])
                if not wait_all_ranks:
                    break
        if missing:
            raise CollectiveTimeoutError(
                f"monitored_barrier on group '{g.group_name}': rank(s) {missing} did not "
                f"arrive within {secs(seconds)}s", tuple(missing))
        o.wait(*[o.send(i, 1, as_bytes(token)) for i in range(1, g.group_size)])

    api._launch(g, "monitored_barrier", "monitored_barrier", body, False, None)
