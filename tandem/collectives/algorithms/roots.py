"""The root checks of rooted collectives that move messages (shared memory checks its own).

A root that only receives (gather, reduce) would hear nothing from a rank that believes
another rank is the root, and both would wait out their deadline. So the root first
sends every other rank an empty message carrying the call's signature (which names the
root). A rank expecting another root sees the two clash: a root waiting for data raises
at once, and the group is aborted on every member. Other ranks post the receive but do
not wait for it (waiting made every non-root wait for its root: measured, small reduce
and gather took twice as long); a clash found after their call returned aborts the
group, so their next call on it fails. Nothing is combined either way: a root completes
only when every rank named it.

A root that only sends (a scatter's) gets the mirror check: every other rank
sends the root an empty message carrying its signature, and the root waits for them
all. Two ranks that both believe they are the root, or that name each other, then each
hold a message of this call with another signature, and raise in this call.

A broadcast checks its root up its own data tree instead
(:mod:`~tandem.collectives.algorithms.spanning`): each rank confirms to its parent
only, so a root waits for its children, not for every rank; within a host whose ranks
share memory, by their posts and announcements in the host's arena
(:mod:`~tandem.collectives.algorithms.shm_spanning`). Across hosts that check is a round
trip per call, so the root returns once its data is sent and the group waits for its
children's confirmations by the end of its next call (:func:`root_returns`): a clash
they bring aborts the group at once, from the thread that read it, and the root's next
call (or ``destroy_process_group``) fails naming the broadcast.
"""

from __future__ import annotations

from tandem.collectives.group import Op
from tandem.transport.base import Slot

__all__ = ["ROOT_STEP", "announce_root", "confirm_root", "confirm_up", "root_returns"]

ROOT_STEP = 2 ** 31 - 1  # beyond the steps of any algorithm


def announce_root(o: Op, root: int, wait: bool = False) -> list[Slot]:
    """The root's announcements to wait for (none on other ranks, unless ``wait``: a
    reduce with a custom op, whose non-roots must learn of a different op in the call)."""
    g = o.group
    empty = memoryview(bytearray(0))
    if g.group_rank == root:
        return [o.send(i, ROOT_STEP, empty) for i in range(g.group_size) if i != root]
    told = o.recv(root, ROOT_STEP, empty)
    if wait:
        return [told]
    g.abort_on_clash([told])
    return []


def confirm_root(o: Op, root: int) -> list[Slot]:
    """The mirror of :func:`announce_root` for a root that only sends: the slots to wait
    for at the end of the call (the non-roots' sends complete locally)."""
    g = o.group
    empty = memoryview(bytearray(0))
    if g.group_rank == root:
        return [o.recv(i, ROOT_STEP, empty) for i in range(g.group_size) if i != root]
    return [o.send(root, ROOT_STEP, empty)]


def confirm_up(o: Op, parent: int, told: list[Slot]) -> list[Slot]:
    """A rank's step up a confirmation tree: once the confirmations ``told`` came (its
    whole subtree named the root), its own to ``parent``; the slot to wait for."""
    o.wait(*told)
    return [o.send(parent, ROOT_STEP, memoryview(bytearray(0)))]


def root_returns(o: Op, sent: list[Slot], told: list[Slot]) -> None:
    """A broadcast root's end across hosts: wait for its sends (then its buffer is the
    caller's again) and leave the confirmations ``told`` still out to the group
    (:meth:`~tandem.collectives.group.ProcessGroup.confirm_later`), so that this call's
    round trip overlaps the next one (gloo's root too returns once its sends are out)."""
    o.wait(*sent)
    o.group.confirm_later(o, told)
