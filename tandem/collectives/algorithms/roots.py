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

A root that only sends (broadcast, scatter) gets the mirror check: every other rank
sends the root an empty message carrying its signature, and the root waits for them
all. Two ranks that both believe they are the root, or that name each other, then each
hold a message of this call with another signature, and raise in this call.

Across hosts the mirror check runs through a tree instead (``tree``; a hierarchical
broadcast's: each host's ranks confirm to its leader, the other leaders to the leader
of the root's host, and that one to the root): a rank confirms to its parent once its
children have confirmed to it, so only leaders confirm across hosts. The root still completes only when every rank named it: each
confirmation it takes matched its signature, and was sent only after its sender's
children matched.
"""

from __future__ import annotations

from typing import Optional

from tandem.collectives.group import Op
from tandem.errors import CollectiveMismatchError
from tandem.transport.base import Slot

__all__ = ["ROOT_STEP", "Tree", "announce_root", "confirm_root", "confirm_up"]

ROOT_STEP = 2 ** 31 - 1  # beyond the steps of any algorithm

# this rank's parent (None on the root) and children in a confirmation tree, group ranks
Tree = tuple[Optional[int], list[int]]


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

    def check(slot: Slot) -> None:
        if isinstance(slot.error, CollectiveMismatchError):
            g.abort(slot.error)

    told.on_done = check
    if told.done():
        check(told)
    return []


def confirm_root(o: Op, root: int, tree: Tree | None = None) -> list[Slot]:
    """The mirror of :func:`announce_root` for a root that only sends: the slots to wait
    for at the end of the call (the non-roots' sends complete locally).

    With ``tree``, the children's confirmations (then :func:`confirm_up` passes this
    rank's on), or on a leaf its own confirmation, sent at once."""
    g = o.group
    empty = memoryview(bytearray(0))
    if tree is not None:
        parent, children = tree
        if children or parent is None:
            return [o.recv(c, ROOT_STEP, empty) for c in children]
        return [o.send(parent, ROOT_STEP, empty)]
    if g.group_rank == root:
        return [o.recv(i, ROOT_STEP, empty) for i in range(g.group_size) if i != root]
    return [o.send(root, ROOT_STEP, empty)]


def confirm_up(o: Op, tree: Tree) -> None:
    """An inner rank's confirmation to its parent, once its children's have arrived
    (after waiting for :func:`confirm_root`'s slots)."""
    parent, children = tree
    if children and parent is not None:
        o.wait(o.send(parent, ROOT_STEP, memoryview(bytearray(0))))
