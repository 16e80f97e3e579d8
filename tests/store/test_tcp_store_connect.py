"""A TCPStore client reaches its server within ``connect_timeout``, or says what it met.

``timeout`` stays the deadline of get/wait; ``connect_timeout`` (default: ``timeout``)
bounds the first connection, name resolution included, and the error names the address
and the cause: a name that does not resolve, or nothing listening.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from tandem import _wire
from tandem.errors import ArgumentError, StoreTimeoutError
from tandem.store.tcp import TCPStore

pytestmark = pytest.mark.timeout(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unresolvable_host_fails_after_connect_timeout_naming_it() -> None:
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        TCPStore("no-such-host.invalid", 29999, timeout=600, connect_timeout=1.0)
    elapsed = time.monotonic() - start
    assert "no-such-host.invalid:29999" in str(info.value)
    assert "does not resolve" in str(info.value)
    assert 0.9 <= elapsed < 20, f"took {elapsed:.1f}s with connect_timeout=1 and timeout=600"


def test_a_port_nobody_listens_on_fails_after_connect_timeout_saying_so() -> None:
    port = _free_port()
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError, match=f"127.0.0.1:{port}.*nothing listens"):
        TCPStore("127.0.0.1", port, timeout=600, connect_timeout=1.0)
    assert time.monotonic() - start < 20


def test_a_server_that_comes_up_within_connect_timeout_is_reached(
        monkeypatch: pytest.MonkeyPatch) -> None:
    port = _free_port()
    holder: list[TCPStore] = []
    refused = threading.Event()  # the client has met nothing listening at least once
    connect = socket.create_connection

    def noting_refusals(*args: Any, **kwargs: Any) -> socket.socket:
        try:
            return connect(*args, **kwargs)
        except ConnectionRefusedError:
            refused.set()
            raise

    monkeypatch.setattr(_wire.socket, "create_connection", noting_refusals)

    def serve_late() -> None:
        refused.wait(30)
        holder.append(TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False))

    t = threading.Thread(target=serve_late)
    t.start()
    try:
        client = TCPStore("127.0.0.1", port, timeout=30, connect_timeout=20)
        t.join()
        assert refused.is_set(), "the server came up before the client first tried"
        holder[0].set("k", b"v")
        assert client.get("k") == b"v"
        assert client.timeout.total_seconds() == 30  # get/wait keep their own deadline
        client.close()
    finally:
        t.join()
        for s in holder:
            s.close()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0, -1])
def test_a_connect_timeout_that_bounds_nothing_is_refused(value: float) -> None:
    with pytest.raises(ArgumentError, match="connect_timeout"):
        TCPStore("127.0.0.1", 1, connect_timeout=value)
