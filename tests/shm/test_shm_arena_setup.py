"""An arena over one segment exports that segment once, not once per member: at a host's
first barrier (32 members) each rank's arena took the mapping's address and a view of
it for every member, twice O(members) ctypes and buffer work in every rank."""

from __future__ import annotations

import mmap
from typing import Any

import pytest

from tandem.transport import _arena
from tandem.transport._arena import CONTROL_BYTES, PID, Arena, segment_bytes
from tandem.transport._shmem import address_of

CHUNK = 4096
MEMBERS = 8


def test_one_segment_is_exported_once_and_each_member_finds_its_area(
        monkeypatch: pytest.MonkeyPatch) -> None:
    one = mmap.mmap(-1, MEMBERS * segment_bytes(CHUNK))
    base = address_of(one)
    exports: list[Any] = []

    def counted(buffer: Any) -> int:
        exports.append(buffer)
        return address_of(buffer)

    monkeypatch.setattr(_arena, "address_of", counted)
    arenas = [Arena(list(range(MEMBERS)), i, one, CHUNK, 1e-4) for i in range(MEMBERS)]
    assert len(exports) == MEMBERS, f"{len(exports)} exports for {MEMBERS} arenas"
    per = len(one) // MEMBERS
    for a in arenas:  # every member's area where it is, seen alike by every member
        assert a._addr == [base + q * per for q in range(MEMBERS)]
        for q in range(MEMBERS):
            assert a._ctl[q][PID] == arenas[q]._ctl[q][PID]
            assert len(a._ctl[q]) * 8 == CONTROL_BYTES
    for a in arenas:
        a.close()
    assert one.closed, "a view of the segment outlived the arenas"


def test_segments_of_their_own_are_each_exported_once() -> None:
    maps = [mmap.mmap(-1, segment_bytes(CHUNK)) for _ in range(3)]
    arenas = [Arena([0, 1, 2], i, maps, CHUNK, 1e-4) for i in range(3)]
    assert arenas[0]._addr == [address_of(m) for m in maps]
    arenas[2]._ctl[2][PID] = 12345
    assert arenas[0]._ctl[2][PID] == 12345
    for a in arenas:
        a.close()
