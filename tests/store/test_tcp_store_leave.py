"""Leaving a TCPStore for good (``TCPStore.leave``), as ``destroy_process_group`` does.

A job that tears down and starts again on the same address meets a new server on the
same port. A client that left must not join the old server again while it is still
up (its data belongs to the previous incarnation, and it is about to close), and the
old server must not close under a client still finishing with it.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tandem.errors import StoreTimeoutError
from tandem.store.tcp import TCPStore

pytestmark = pytest.mark.timeout(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_client_that_left_waits_for_the_next_server_on_the_port() -> None:
    old = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = old.port
    old.set("generation", b"old")
    TCPStore("127.0.0.1", port, timeout=30).leave()
    joined: list[TCPStore] = []
    failed: list[BaseException] = []

    def rejoin() -> None:
        try:
            joined.append(TCPStore("127.0.0.1", port, timeout=30, connect_timeout=30))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            failed.append(exc)

    thread = threading.Thread(target=rejoin)
    thread.start()
    # the old server is still up; the client must not settle on it
    thread.join(1.0)
    assert not joined and not failed, (joined, failed)
    old.close()
    new = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    try:
        new.set("generation", b"new")
        thread.join(20.0)
        assert not failed, failed
        assert joined, "the client did not reach the new server within 20 s of its start"
        assert joined[0].get("generation") == b"new"
        joined[0].close()
    finally:
        new.close()


def test_a_client_that_left_names_the_old_server_at_its_connect_deadline() -> None:
    old = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        TCPStore("127.0.0.1", old.port, timeout=30).leave()
        start = time.monotonic()
        with pytest.raises(StoreTimeoutError, match="still the one this process left"):
            TCPStore("127.0.0.1", old.port, timeout=30, connect_timeout=1.0)
        assert time.monotonic() - start < 15
    finally:
        old.close()


def test_the_master_leaving_waits_for_its_clients_to_hang_up() -> None:
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", master.port, timeout=30)
    client.set("k", b"v")
    gone = threading.Event()
    leaver = threading.Thread(target=lambda: (master.leave(linger=30.0), gone.set()))
    leaver.start()
    try:
        assert not gone.wait(1.0), "the master closed its server under a connected client"
        assert client.get("k") == b"v"  # still served while it lingers
        hung_up = time.monotonic()
        client.leave()
        assert gone.wait(20.0), "the master did not close within 20 s of its last client"
        assert time.monotonic() - hung_up < 20.0
    finally:
        client.close()
        leaver.join(40.0)


def test_the_master_leaving_stops_waiting_at_its_linger() -> None:
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", master.port, timeout=30)
    try:
        start = time.monotonic()
        master.leave(linger=0.5)
        assert 0.4 < time.monotonic() - start < 15.0
    finally:
        client.close()


def test_a_plain_close_lets_this_process_join_the_same_server_again() -> None:
    # close() (not leave) keeps its meaning: another client of this process may rejoin
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        TCPStore("127.0.0.1", master.port, timeout=30).close()
        again = TCPStore("127.0.0.1", master.port, timeout=30, connect_timeout=5)
        master.set("k", b"v")
        assert again.get("k") == b"v"
        again.close()
    finally:
        master.close()
