"""One call among some ranks of its group: the phases of hierarchical collectives.

``host_layout(group)`` says which group ranks share a host; ``Phase(op, members, base)``
is ``op`` restricted to ``members`` (numbered from 0 in that order), so that the tree,
doubling and ring algorithms run among them unchanged, their step numbers shifted by
``base`` so that the phases of one call never take each other's messages.
"""

from __future__ import annotations

from typing import cast

import torch

# host_layout lives with the group, whose first call makes the host's arena by it
from tandem.collectives.group import Op, ProcessGroup, host_layout
from tandem.transport.base import Slot

__all__ = ["PHASE", "Phase", "host_layout", "host_of_rank"]

# The phases of one call share its sequence number, so their step numbers live in
# disjoint ranges: a message that arrives early for a later phase is never taken for
# one of an earlier phase. Ring steps grow with the buffer (up to two per chunk):
# 2^28 steps need a 512 GiB buffer even at the smallest chunk (TANDEM_CHUNK_BYTES=4096).
PHASE = 1 << 28


def host_of_rank(layout: list[list[int]], rank: int) -> list[int]:
    """The group ranks on ``rank``'s host (``rank`` among them)."""
    return next(ranks for ranks in layout if rank in ranks)


class _Subset:
    """Some ranks of ``outer`` (its group ranks ``members``), numbered from 0 in that order.

    Exactly what :class:`Op` and the tree, doubling and ring algorithms read of a group
    (they address peers by group rank), so that on a :class:`Phase` of this view they
    run among the members only. It is not a process group of its own (constructing one
    would set up per-group state such as shared staging memory): messages keep the
    outer group's id, and an attribute missing here fails loudly in the tests.
    """

    def __init__(self, outer: ProcessGroup, members: list[int], reserved: int = 0) -> None:
        self.outer = outer
        self.reserved = reserved  # bytes at the start of the outer scratch left to the caller
        self.transport = outer.transport
        self.group_id = outer.group_id
        self.group_name = outer.group_name
        self.settings = outer.settings
        self.ranks = [outer.ranks[m] for m in members]
        self.group_rank = members.index(outer.group_rank)
        self.group_size = len(members)

    def scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        # one working buffer per group, as ever, past what the caller reserved for itself
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        return self.outer.scratch(self.reserved + nbytes, torch.uint8)[self.reserved:].view(dtype)


class Phase(Op):
    """One phase of ``outer`` among ``members``, its step numbers shifted by ``base``.

    ``reserved`` bytes at the start of the group's scratch memory stay the caller's:
    the phase's algorithm gets its working memory after them.
    """

    __slots__ = ("outer", "base")

    def __init__(self, outer: Op, members: list[int], base: int, reserved: int = 0) -> None:
        view = cast(ProcessGroup, _Subset(outer.group, members, reserved))
        super().__init__(view, outer.name, outer.seq, outer.sig, outer.site)
        self.deadline = outer.deadline
        self.algorithm = outer.algorithm
        self.outer = outer
        self.base = base

    def send(self, to: int, step: int, view: memoryview) -> Slot:
        return super().send(to, self.base + step, view)

    def recv(self, frm: int, step: int, view: memoryview) -> Slot:
        return super().recv(frm, self.base + step, view)

    def describe(self) -> str:
        return self.outer.describe()  # errors name the user's call and the whole group
