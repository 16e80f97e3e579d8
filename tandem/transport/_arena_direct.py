"""An arena's direct access to its members' memory: who may read and write whom, and where.

A collective may move bytes straight between the members' tensors with cross-memory
reads and writes (``_cma``; the algorithm is
``tandem.collectives.algorithms.shm_direct``) instead of staging them. The words it
needs sit in each member's control area (see ``_arena``'s layout): the member's pid
and the address where it mapped its own segment, written once when the arena is made,
so a peer can probe whether the kernel lets it read and write this process
(:meth:`DirectAccess.probe_direct`); the verdict of this member's own probe; and the
address of the tensor it works on in the current call (:meth:`publish_buffer`)::

    arena.publish_buffer(t.data_ptr()); arena.post(); arena.wait_all(...)
    arena.read_member(q, arena.buffer_of(q) + offset, scratch.data_ptr(), nbytes)
"""

from __future__ import annotations

import torch

from tandem.transport import _cma

__all__ = ["DirectAccess", "PID", "HERE", "VERDICT", "BUFFER"]

PID, HERE, VERDICT, BUFFER = 1, 2, 3, 4  # u64 indexes in a member's control area


class DirectAccess:
    """The direct-access half of :class:`~tandem.transport.Arena` (its base class)."""

    index: int
    size: int
    _ctl: list[memoryview]
    _scratch: torch.Tensor | None
    # whether every member may read and write every member's memory: None until the
    # members agreed (shm_direct does that in its first call)
    direct: bool | None

    def scratch(self, nbytes: int) -> torch.Tensor:
        """A private buffer of at least ``nbytes`` (uint8), kept for the next call."""
        if self._scratch is None or len(self._scratch) < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
            self._scratch.zero_()  # fault it in now, not inside a timed call
        return self._scratch

    def probe_direct(self) -> bool:
        """Whether this process may read and write every other member's memory; the
        answer is published as this member's verdict (:meth:`verdict`)."""
        ok = _cma.available()
        for q in range(self.size):
            if ok and q != self.index:
                ctl = self._ctl[q]
                ok = _cma.may_write(int(ctl[PID]), int(ctl[HERE]) + 8 * PID, int(ctl[PID]))
        self._ctl[self.index][VERDICT] = 1 if ok else 2
        return ok

    def verdict(self, member: int) -> bool | None:
        """``member``'s published :meth:`probe_direct` answer (None: not yet)."""
        v = self._ctl[member][VERDICT]
        return None if v == 0 else v == 1

    @staticmethod
    def direct_possible() -> bool:
        """Whether this system has cross-memory reads and writes at all."""
        return _cma.available()

    def read_member(self, member: int, address: int, local: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``address`` of ``member``'s process to ``local`` (OSError:
        the kernel refused, or the process is gone)."""
        _cma.read_from(int(self._ctl[member][PID]), local, address, nbytes)

    def write_member(self, member: int, address: int, local: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``local`` to ``address`` of ``member``'s process."""
        _cma.write_to(int(self._ctl[member][PID]), address, local, nbytes)

    def publish_buffer(self, address: int) -> None:
        """Where this member's tensor of the current call is (before the call's post)."""
        self._ctl[self.index][BUFFER] = address

    def buffer_of(self, member: int) -> int:
        """The address of ``member``'s published tensor, in its process."""
        return int(self._ctl[member][BUFFER])
