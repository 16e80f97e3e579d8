"""TCPStore beyond the Store contract: processes, authentication, hostile peers, failures."""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time
from typing import Any, Iterator

import _store_children as children
import pytest

from tandem import _wire
from tandem.errors import (
    ArgumentError,
    AuthenticationError,
    StateError,
    StoreError,
    StoreTimeoutError,
)
from tandem.store import TCPStore
from tandem.store.tcp import MAX_VALUE, PURPOSE
from tandem.testing import wait_until

HOST = "127.0.0.1"
# Deadline for anything that includes starting a spawned child (it imports torch:
# about 2s on an idle machine, more on a busy one). Passing runs take far less.
CHILD_START = 20.0


@pytest.fixture
def master() -> Iterator[TCPStore]:
    store = TCPStore(HOST, 0, is_master=True, timeout=5)
    yield store
    store.close()


def _free_port() -> int:
    # Only for the cases that need a port before the master exists (a master that waits
    # for workers in its constructor, multi_tenant); everything else uses port 0.
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _closed_by_peer(sock: socket.socket, within: float = 2.0) -> bool:
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_port_zero_picks_a_free_port_and_reports_it(master: TCPStore) -> None:
    assert master.port > 0
    assert master.host == HOST
    with TCPStore(HOST, master.port, timeout=5) as client:
        client.set("k", b"v")
    assert master.get("k") == b"v"


def test_server_binds_exactly_the_requested_host(master: TCPStore) -> None:
    assert master._server is not None
    assert master._server.address == (HOST, master.port)


def test_non_master_needs_a_port() -> None:
    with pytest.raises(ArgumentError, match="port"):
        TCPStore(HOST, 0, timeout=1)


@pytest.mark.parametrize("kwargs, message", [
    ({"host_name": None}, "host_name must be a str"),
    ({"host_name": b"127.0.0.1"}, "host_name must be a str"),
    ({"is_master": "no"}, "is_master must be True or False, got 'no'"),
    ({"wait_for_workers": "false"}, "wait_for_workers must be True or False"),
    ({"multi_tenant": 2}, "multi_tenant must be True or False"),
    ({"port": True}, "port and world_size are ints"),
    ({"world_size": True}, "port and world_size are ints"),
    ({"secret": 10 ** 9}, "secret must be bytes or str"),  # was a gigabyte of zero bytes
    ({"secret": 5}, "secret must be bytes or str"),  # was five zero bytes: a weak secret
])
def test_constructor_arguments_of_the_wrong_type_are_refused_naming_them(
        kwargs: dict[str, Any], message: str) -> None:
    # is_master="no" made a master; host_name=None failed deep in the wire code
    args: dict[str, Any] = {"host_name": "127.0.0.1", "port": 0, "is_master": True,
                            "timeout": 5, **kwargs}
    with pytest.raises(ArgumentError, match=message):
        TCPStore(**args)


@pytest.mark.smoke("tandem.store")
@pytest.mark.procs
def test_two_processes_share_a_store(master: TCPStore, spawn: Any) -> None:
    child = spawn(children.tcp_worker, master.port)
    master.set("parent", b"from parent")
    master.wait(["child", "done"], timeout=CHILD_START)
    assert master.get("child") == b"from child"
    child.join(CHILD_START)
    assert child.exitcode == 0


@pytest.mark.procs
def test_master_waits_until_world_size_workers_joined(spawn: Any) -> None:
    port = _free_port()
    child = spawn(children.tcp_joining_worker, port)
    with TCPStore(HOST, port, world_size=2, is_master=True, timeout=CHILD_START) as store:
        assert store.get("child-joined") == b"1"
        assert store.num_keys() == 1  # the join counter is internal
        child.join(CHILD_START)  # before closing the server, which fails the child's calls in flight
    assert child.exitcode == 0


def test_master_times_out_naming_how_many_workers_joined() -> None:
    with pytest.raises(StoreTimeoutError, match="1 of 3 workers"):
        TCPStore(HOST, 0, world_size=3, is_master=True, timeout=0.3)


def test_wrong_secret_raises_authentication_error_and_server_keeps_serving(
    master: TCPStore,
) -> None:
    with pytest.raises(AuthenticationError):
        TCPStore(HOST, master.port, timeout=5, secret=b"not the job secret")
    with TCPStore(HOST, master.port, timeout=5) as good:
        good.set("still", b"serving")
        assert master.get("still") == b"serving"


def test_hostile_connections_do_not_disturb_other_clients(
    master: TCPStore, job_secret: bytes
) -> None:
    idle = socket.create_connection((HOST, master.port))
    garbage = socket.create_connection((HOST, master.port))
    garbage.sendall(os.urandom(4096))
    huge_unauthenticated = socket.create_connection((HOST, master.port))
    huge_unauthenticated.sendall(b"\xff" * 80)
    huge_after_handshake = socket.create_connection((HOST, master.port))
    _wire.client_handshake(huge_after_handshake, job_secret, PURPOSE)
    huge_after_handshake.sendall(struct.pack("!I", 0xFFFFFFFF))
    unknown_op = socket.create_connection((HOST, master.port))
    _wire.client_handshake(unknown_op, job_secret, PURPOSE)
    _wire.send_frame(unknown_op, b"\x63junk")
    try:
        start = time.monotonic()
        with TCPStore(HOST, master.port, timeout=5) as good:
            good.set("k", b"v")
            assert master.get("k") == b"v"
        assert time.monotonic() - start < 4.0  # within the client's 5 s timeout
        for sock in (garbage, huge_unauthenticated, huge_after_handshake, unknown_op):
            assert _closed_by_peer(sock), "the server kept a bad connection open"
    finally:
        for sock in (idle, garbage, huge_unauthenticated, huge_after_handshake, unknown_op):
            sock.close()


def test_value_over_the_cap_is_refused_before_sending(master: TCPStore) -> None:
    with pytest.raises(ArgumentError, match="exceeds"):
        master.set("big", bytes(MAX_VALUE + 1))
    master.set("small", b"ok")  # the connection is still usable
    assert master.get("small") == b"ok"


def test_appends_that_would_grow_a_value_past_the_cap_are_refused(master: TCPStore) -> None:
    half = b"x" * (MAX_VALUE // 2 + 1)
    master.append("grow", half)
    with pytest.raises(ArgumentError, match="would exceed"):
        master.append("grow", half)
    assert len(master.get("grow")) == len(half)  # the refused append changed nothing
    master.set("small", b"ok")  # and the server still serves
    assert master.get("small") == b"ok"


def test_multi_get_and_multi_set_are_one_request_each(master: TCPStore) -> None:
    # start-up reads every rank's entry at once: a request per key made it O(world^2)
    ops: list[str] = []
    call = master._client.call

    def counting(op: Any, fields: Any, wait: float = 0.0) -> Any:
        ops.append(op.name)
        return call(op, fields, wait)

    master._client.call = counting  # type: ignore[method-assign]
    keys = [f"k{i}" for i in range(64)]
    master.multi_set(keys, [str(i) for i in range(64)])
    assert master.multi_get(keys[::-1]) == [str(i).encode() for i in range(63, -1, -1)]
    assert ops == ["MULTI_SET", "MULTI_GET"]


def test_multi_get_over_the_reply_limit_is_refused_naming_it(
        master: TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.store import _tcp_server

    master.multi_set(["a", "b"], [b"x" * 600, b"y" * 600])
    monkeypatch.setattr(_tcp_server, "MAX_FRAME", 1000)
    with pytest.raises(ArgumentError, match="reply limit; ask for fewer keys"):
        master.multi_get(["a", "b"])
    assert master.multi_get(["a"]) == [b"x" * 600]  # the connection still serves


def test_writes_to_other_keys_do_not_wake_blocked_gets(master: TCPStore) -> None:
    # 64 ranks counting themselves in with add woke every rank blocked on "go" each time
    server = master._server
    assert server is not None
    waiters = [TCPStore(HOST, master.port, timeout=30) for _ in range(8)]
    got: list[bytes] = []
    threads = [threading.Thread(target=lambda w=w: got.append(w.get("go")), daemon=True)
               for w in waiters]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sum(server._wanted.values()) < len(waiters):  # every waiter is blocked
            assert time.monotonic() < deadline, "the waiters never blocked"
            time.sleep(0.01)
        before = server.wakeups
        for _ in range(200):
            master.add("joined", 1)
        master.set("go", b"1")
        for t in threads:
            t.join(30)
        assert got == [b"1"] * len(waiters)
        # one wake-up each for "go" (a few spurious ones allowed), not one per add
        assert server.wakeups - before <= 3 * len(waiters), server.wakeups - before
    finally:
        for w in waiters:
            w.close()


def test_32_clients_block_on_get_until_one_set_wakes_them(master: TCPStore) -> None:
    results: list[bytes | BaseException] = []
    lock = threading.Lock()

    def client() -> None:
        value: bytes | BaseException
        try:
            with TCPStore(HOST, master.port, timeout=5) as store:
                store.add("joined", 1)
                value = store.get("go")
        except BaseException as exc:  # reported by the assertion below
            value = exc
        with lock:
            results.append(value)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(32)]
    for thread in threads:
        thread.start()
    master.wait(["joined"])
    deadline = time.monotonic() + 5
    while master.get("joined") != b"32" and time.monotonic() < deadline:
        time.sleep(0.01)
    master.set("go", b"now")
    for thread in threads:
        thread.join(5)
    assert results == [b"now"] * 32


def test_closing_the_server_fails_a_blocked_client_promptly(master: TCPStore) -> None:
    client = TCPStore(HOST, master.port, timeout=30)
    errors: list[BaseException] = []

    def blocked_get() -> None:
        try:
            client.get("never")
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=blocked_get, daemon=True)
    thread.start()
    server = master._server
    assert server is not None
    wait_until(lambda: any(k.endswith(b"never") for k in server._wanted),
               "the server to hold the client's get")
    start = time.monotonic()
    master.close()
    thread.join(15)
    assert time.monotonic() - start < 10.0  # a third of the get's 30 s
    assert len(errors) == 1 and isinstance(errors[0], StoreError)
    with pytest.raises(StoreError):
        client.set("after", b"x")
    client.close()


def _waits_in(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is inside a call of ``function`` now."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


@pytest.mark.procs
def test_killed_server_process_fails_clients_promptly(spawn: Any, mp_queue: Any) -> None:
    server = spawn(children.tcp_master, mp_queue)
    port = mp_queue.get(timeout=CHILD_START)
    client = TCPStore(HOST, port, timeout=30)
    client.set("alive", b"1")
    errors: list[BaseException] = []

    def blocked_get() -> None:
        try:
            client.get("never")
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=blocked_get, daemon=True)
    thread.start()
    wait_until(lambda: _waits_in(thread, "recv_frame"), "the get to wait for its reply")
    start = time.monotonic()
    server.kill()
    thread.join(15)
    assert time.monotonic() - start < 10.0  # a third of the get's 30 s
    assert len(errors) == 1 and isinstance(errors[0], StoreError), errors
    with pytest.raises(StoreError):
        client.get("alive")
    client.close()


def test_closed_store_raises_state_error(master: TCPStore) -> None:
    client = TCPStore(HOST, master.port, timeout=5)
    client.close()
    client.close()  # idempotent
    with pytest.raises(StateError):
        client.set("k", b"v")


def test_close_leaves_no_store_threads_running() -> None:
    store = TCPStore(HOST, 0, is_master=True, timeout=5)
    other = TCPStore(HOST, store.port, timeout=5)
    other.set("k", b"v")
    other.close()
    store.close()
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        alive = [t for t in threading.enumerate() if t.name.startswith(f"tandem-store-server:{store.port}")]
        if not alive:
            break
        time.sleep(0.01)
    assert not alive
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("tandem-store"))


@pytest.mark.procs
def test_a_process_with_an_open_store_still_exits(spawn: Any) -> None:
    child = spawn(children.tcp_master_left_open, 3)
    child.join(CHILD_START)
    assert child.exitcode == 0


def test_multi_tenant_masters_share_one_server() -> None:
    port = _free_port()
    first = TCPStore(HOST, port, is_master=True, multi_tenant=True, timeout=5)
    second = TCPStore(HOST, port, is_master=True, multi_tenant=True, timeout=5)
    first.set("shared", b"yes")
    assert second.get("shared") == b"yes"
    first.close()
    assert second.get("shared") == b"yes"  # the server lives while a tenant does
    second.close()
