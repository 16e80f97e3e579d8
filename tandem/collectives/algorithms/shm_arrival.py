"""A host leader's part of a small broadcast done by the thread that receives the data.

Another host's leader in :mod:`~.shm_spanning` takes the root's data in one message,
stages it in its host's arena, and confirms the root to its parent once every rank of
its host announced this call. Done by the caller, that is two wake-ups in a row on
the root's path: the transport's reader thread takes the message and wakes the
caller, which stages and confirms. Here the reader thread does it as the message
lands (:func:`arrive_and_stage`), when it can without waiting: the staging half is
free (every rank of the host has posted as often as the leader) and, for the
confirmation, every other rank of the host has posted this call's first phase and
announced this very call. Anything else is left to the caller, which waits and
checks as before, so a rank that names another root still meets the same clash.
"""

from __future__ import annotations

import threading
import time

import torch

from tandem.collectives.algorithms.roots import ROOT_STEP
from tandem.collectives.group import Op
from tandem.errors import StateError
from tandem.transport import Arena
from tandem.transport.base import Flag, Slot

__all__ = ["arrive_and_stage"]


def arrive_and_stage(op: Op, arena: Arena, view: memoryview, raw: torch.Tensor,
                     parent: int) -> tuple[bool, Slot | None]:
    """Receive ``view`` (all of ``raw``'s bytes, one round of ``arena``) from group rank
    ``parent``; returns (whether it was staged and posted as round ``arena.posted`` of
    the call, the confirmation sent to ``parent`` or None). Raises as ``op.wait`` does."""
    base = arena.posted
    index = arena.index
    n = len(view)
    once = threading.Lock()
    finished = Flag()
    staged: list[bool] = [False]
    confirmation: list[Slot | None] = [None]
    failure: list[BaseException | None] = [None]
    linked = op.group.transport.connected(op.group.ranks[parent])

    def arrived(slot: Slot) -> None:
        if not once.acquire(blocking=False):
            return  # run by the other thread
        try:
            if slot.error is None and not arena.lagging(base):
                # nobody still reads the half this round overwrites (round base - 2)
                arena.heads(torch.uint8, n)[base % 2][index].copy_(raw)
                # every other rank of the host posted this call's first phase, naming
                # it; and the link is up (a first connection would hold this thread)
                if arena.lagging(base + 1) == [index] and linked and all(
                        arena.holds(q, op.seq, op.sig) for q in range(arena.size) if q != index):
                    # before the post: its wake-ups may take this CPU away
                    confirmation[0] = op.send(parent, ROOT_STEP, memoryview(bytearray(0)))
                arena.post()
                staged[0] = True
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, never the reader
            failure[0] = exc
        finally:
            finished.set()

    slot = op.recv(parent, 0, view)
    slot.on_done = arrived
    if slot.done():  # it completed before the hook was in place
        arrived(slot)
    op.wait(slot)
    # the receiving thread runs arrived() right after completing the slot: a moment
    if not finished.wait(max(1.0, op.deadline - time.monotonic())):  # 1 s: even at the deadline
        raise StateError(f"{op.describe()}: the thread that received the broadcast did not "
                         f"finish staging it by the call's deadline (or 1 s after it)")
    if failure[0] is not None:
        raise failure[0]
    return staged[0], confirmation[0]
