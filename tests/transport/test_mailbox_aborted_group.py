"""A failed group receives nothing more, not even what arrived before it failed.

Found by a flaky run: two ranks each named the other as a reduce's root, so both only
sent. Rank 0 learnt of the clash (a stray for its finished reduce) and aborted the
group, yet its next call on the group, a barrier already under way, found the peer's
barrier message parked and completed from it. The barrier must fail like any receive of
an aborted group; parked messages of the group are let go, later ones are not kept.
"""

from __future__ import annotations

import pytest

from tandem.errors import CollectiveMismatchError
from tandem.transport.mailbox import Mailbox
from tandem.transport.message import Header, Kind, reader_of

GROUP = 7


def _arrive(box: Mailbox, seq: int, payload: bytes = b"\x01") -> None:
    header = Header(Kind.COLL, GROUP, seq, 1, len(payload), b"barrier", b"t.py:1")
    box.arrive(1, header, reader_of(memoryview(payload)))


def test_a_parked_message_of_an_aborted_group_does_not_complete_a_receive() -> None:
    box = Mailbox(rank=0)
    _arrive(box, seq=1)  # the peer's barrier message, ahead of our barrier
    error = CollectiveMismatchError("the ranks disagreed on the root")
    box.abort_group(GROUP, error)
    slot = box.post(1, Kind.COLL, GROUP, 1, 1, memoryview(bytearray(1)), b"barrier", b"t.py:1")
    assert slot.done() and slot.error is error


def test_a_wildcard_receive_of_an_aborted_group_fails_too() -> None:
    box = Mailbox(rank=0)
    _arrive(box, seq=1)
    error = CollectiveMismatchError("the ranks disagreed on the root")
    box.abort_group(GROUP, error)
    slot = box.post_any([1], Kind.COLL, GROUP, memoryview(bytearray(1)), lambda p, h: True)
    assert slot.done() and slot.error is error


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_aborted_group_keeps_no_early_messages(when: str) -> None:
    box = Mailbox(rank=0)
    if when == "before":
        _arrive(box, seq=1, payload=bytes(1000))
        assert box._parked_bytes == 1000
    box.abort_group(GROUP, CollectiveMismatchError("x"))
    if when == "after":
        _arrive(box, seq=1, payload=bytes(1000))
    assert box._parked_bytes == 0 and not box._parked
    assert box.parked_call(GROUP, 1) is None


def test_other_groups_keep_their_early_messages() -> None:
    box = Mailbox(rank=0)
    _arrive(box, seq=1)
    box.abort_group(GROUP + 1, CollectiveMismatchError("another group"))
    slot = box.post(1, Kind.COLL, GROUP, 1, 1, memoryview(bytearray(1)), b"barrier", b"t.py:1")
    assert slot.done() and slot.error is None
