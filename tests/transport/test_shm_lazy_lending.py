"""A local pair's lending state (``tandem.transport._lend``) is made on the pair's first
large RPC message, not at init for every pair: at 32 ranks on a host each rank made 31
of each (a lender, a borrower and their closures) that the first barrier never uses.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from _pair import connected_pair, rpc_sender
from tandem.transport._lend import LEND_MIN
from tandem.transport.shm import ShmTransport, unsupported_reason

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(bool(unsupported_reason()), reason=unsupported_reason())]


@pytest.fixture
def trio() -> Iterator[list[ShmTransport]]:
    made = connected_pair(lambda rank, store: ShmTransport(
        rank, 3, store, b"lazy-lend-secret", hostname="h"), ShmTransport, n=3)
    yield made
    for t in made:
        t.close()


def _made(t: ShmTransport) -> dict[int, tuple[bool, bool]]:
    return {r: (p.lender is not None, p.borrowed is not None) for r, p in t._peers.items()}


def test_lending_state_is_made_by_the_first_large_rpc_message(trio: list[ShmTransport]
                                                              ) -> None:
    a, b, c = trio
    none = (False, False)
    assert [_made(t) for t in trio] == [{1: none, 2: none}, {0: none, 2: none},
                                        {0: none, 1: none}]
    send = rpc_sender(a, b, 1)
    send(b"s" * 64)  # small: still nothing made
    assert _made(a)[1] == none and _made(b)[0] == none
    big = bytes(range(256)) * (2 * LEND_MIN // 256)
    send(big)  # large: the sender lends a segment, the receiver borrows it
    both = (True, True)
    assert _made(a) == {1: both, 2: none}
    assert _made(b) == {0: both, 2: none}
    assert _made(c) == {0: none, 1: none}
    lender = a._peers[1].lender
    assert lender is not None and lender.segments()[0] >= 1  # it went lent, not copied
    send(big[::-1])  # the same state serves the next one
    assert a._peers[1].lender is lender
