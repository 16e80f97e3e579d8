"""Durations in messages: three significant digits, so a positive timeout never shows as 0."""

from __future__ import annotations

import pytest

import tandem
from tandem._words import secs
from tandem.collectives.group import ProcessGroup
from tandem.config import Settings
from tandem.errors import CollectiveTimeoutError, StoreTimeoutError
from tandem.transport.loopback import LoopbackHub

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("value, shown", [
    (0.04, "0.04"), (0.0312, "0.0312"), (0.000123, "0.000123"), (1e-9, "0.000000001"),
    (0.099999, "0.1"), (1.0, "1"), (1.5, "1.5"), (30.0, "30"), (99.96, "100"), (1800.0, "1800"),
    (12345.6, "12346"), (0.0, "0"), (float("inf"), "inf"),
])
def test_a_duration_shows_three_significant_digits_without_exponent(value: float,
                                                                      shown: str) -> None:
    assert secs(value) == shown


def test_a_store_wait_of_20_ms_says_so() -> None:
    with pytest.raises(StoreTimeoutError, match=r"within 0\.02s"):
        tandem.HashStore().wait(["never"], timeout=0.02)


def test_a_monitored_barrier_of_30_ms_says_so() -> None:
    hub = LoopbackHub(2)  # rank 1 never comes: rank 0 waits out the barrier's timeout
    g = ProcessGroup(hub.transports[0], [0, 1], 0, "durations", 10.0, Settings(), "loopback")
    with pytest.raises(CollectiveTimeoutError, match=r"within 0\.03s"):
        tandem.monitored_barrier(group=g, timeout=0.03)
