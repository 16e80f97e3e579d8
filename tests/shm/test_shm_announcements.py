"""Which call each member announced in its staging segment (``Arena.announce``), read
back by a peer: the whole entry (``announcement``) and the quick check (``holds``)."""

from __future__ import annotations

import mmap
from typing import Iterator

import pytest

from tandem.transport._arena import _CALLS, _ENTRY, _KEPT, Arena, segment_bytes

CHUNK = 4096
SIG = b"all_reduce(float32[1024], op=SUM, algorithm=shm)"


@pytest.fixture(params=["a segment each", "one segment"])
def pair(request: pytest.FixtureRequest) -> Iterator[list[Arena]]:
    if request.param == "one segment":  # what ShmTransport.arena makes
        one = mmap.mmap(-1, 2 * segment_bytes(CHUNK))
        arenas = [Arena([0, 1], i, one, CHUNK, 1e-4) for i in range(2)]
    else:
        maps = [mmap.mmap(-1, segment_bytes(CHUNK)) for _ in range(2)]
        arenas = [Arena([0, 1], i, maps, CHUNK, 1e-4) for i in range(2)]
    yield arenas
    arenas[0].close()


def test_a_peer_reads_back_the_call_a_member_announced(pair: list[Arena]) -> None:
    pair[1].announce(7, SIG, b"train.py:12")
    assert pair[0].announcement(1, 7) == (7, SIG, b"train.py:12")
    assert pair[0].holds(1, 7, SIG)


def test_holds_is_false_for_another_signature_or_call(pair: list[Arena]) -> None:
    pair[1].announce(7, SIG, b"train.py:12")
    assert not pair[0].holds(1, 7, SIG.replace(b"SUM", b"MAX"))
    assert not pair[0].holds(1, 7, SIG + b"x")
    assert not pair[0].holds(1, 7, SIG[:-1])
    assert not pair[0].holds(1, 11, SIG)  # the same entry, a later call
    assert not pair[0].holds(1, 3, SIG)  # the same entry, an earlier call
    assert pair[0].announcement(1, 11) == (7, SIG, b"train.py:12")


def test_an_entry_being_rewritten_holds_nothing(pair: list[Arena]) -> None:
    pair[1].announce(7, SIG, b"train.py:12")
    ctl = pair[1]._ctl[1]
    word = (_CALLS + (7 % _KEPT) * _ENTRY) // 8  # as while its writer rewrites it
    assert ctl[word] == 8
    ctl[word] = 0
    assert not pair[0].holds(1, 7, SIG)
    assert pair[0].announcement(1, 7) is None


def test_nothing_announced_yet_reads_as_call_minus_one(pair: list[Arena]) -> None:
    assert pair[0].announcement(1, 0) == (-1, b"", b"")
    assert not pair[0].holds(1, 0, b"")


def test_a_long_call_site_is_cut_to_fit_its_entry(pair: list[Arena]) -> None:
    pair[1].announce(2, SIG, b"s" * 4000)
    seq, sig, site = pair[0].announcement(1, 2)
    assert (seq, sig) == (2, SIG) and site == b"s" * (_ENTRY - 24 - len(SIG))
