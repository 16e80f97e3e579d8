"""Strangers, wrong secrets and garbage cannot join a job or disturb it.

Covers the three listeners a job has: the transport's rendezvous listener (a rank with
the wrong secret; a stranger sending garbage to a published port), the TCPStore server
(wrong secret, junk, a huge length prefix, idle and half-finished handshakes next to a
working client) and where listeners bind (the address published in the store).
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem as dist
from _fault_helpers import attempt, values
from tandem import _gate, _wire
from tandem.collectives.world import bind_address, world
from tandem.config import Settings, load_secret
from tandem.errors import ArgumentError, AuthenticationError, StoreError
from tandem.store.tcp import PURPOSE as STORE_PURPOSE
from tandem.testing import launch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(90)]

CONNECT_TIMEOUT = 3.0
TRANSPORT_PURPOSE = b"tandem-transport"


# -- a rank with the wrong secret --------------------------------------------------------

def _wrong_secret_rank(rank: int, world_size: int, store_path: str) -> Any:
    if rank == 1:
        os.environ["TANDEM_SECRET"] = "not-the-job-secret"
    result = attempt(dist.init_process_group, "tcp", init_method=f"file://{store_path}",
                     rank=rank, world_size=world_size, timeout=30)
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


@pytest.fixture(scope="module")
def wrong_secret(tmp_path_factory: Any) -> dict[int, Any]:
    path = str(tmp_path_factory.mktemp("secret") / "store")
    outcomes = launch(2, _wrong_secret_rank, (path,), init=False, timeout=40,
                      env={"TANDEM_CONNECT_TIMEOUT": str(CONNECT_TIMEOUT)})
    return values(outcomes, [0, 1])


def test_rank_with_the_wrong_secret_cannot_join(wrong_secret: Any) -> None:
    r = wrong_secret[1]
    assert not r["ok"] and r["type"] == "AuthenticationError", r
    assert "secret" in r["msg"], r
    assert r["elapsed"] < CONNECT_TIMEOUT + 2.0, r


def test_good_rank_fails_its_connect_deadline_naming_the_missing_rank(wrong_secret: Any) -> None:
    r = wrong_secret[0]
    assert not r["ok"] and "NetworkError" in r["types"], r
    assert "rank(s) [1]" in r["msg"] and "did not connect" in r["msg"], r
    assert CONNECT_TIMEOUT - 0.5 < r["elapsed"] < CONNECT_TIMEOUT + 3.0, r


# -- a stranger at the transport listener during rendezvous ------------------------------

_KEEP: list[socket.socket] = []


def _attack(host: str, port: int) -> dict[str, str]:
    """Hit ``host:port`` the ways a stranger could; describe what each attacker saw."""
    seen: dict[str, str] = {}
    junk = socket.create_connection((host, port), timeout=5)
    junk.sendall(os.urandom(4096))
    wrong = socket.create_connection((host, port), timeout=5)
    try:
        _wire.client_handshake(wrong, b"not-the-job-secret", TRANSPORT_PURPOSE)
        seen["wrong_secret"] = "accepted"
    except AuthenticationError as exc:
        seen["wrong_secret"] = f"AuthenticationError: {exc}"
    huge = socket.create_connection((host, port), timeout=5)
    huge.sendall(struct.pack("!I", 0xFFFFFFFF) * 32)  # no length is read before the handshake
    half = socket.create_connection((host, port), timeout=5)
    half.recv(40)
    half.sendall(_wire.MAGIC + b"\x00" * 10)
    half.close()  # leaves mid-handshake
    idle = socket.create_connection((host, port), timeout=5)  # says nothing at all
    for name, sock in (("junk", junk), ("huge", huge)):
        try:
            sock.settimeout(3.0)
            while sock.recv(4096):
                pass
            seen[name] = "closed"
        except OSError as exc:
            seen[name] = f"closed ({type(exc).__name__})"
        sock.close()
    _KEEP.append(idle)  # stays open, saying nothing, while the job forms
    return seen


def _stranger_during_rendezvous(rank: int, world_size: int, store_path: str) -> Any:
    store = dist.FileStore(store_path, world_size)
    seen: dict[str, str] = {}
    if rank == 1:
        probe = dist.FileStore(store_path)  # world_size -1: its close is not counted
        addr = probe.get("tandem/0/addr/0").decode()  # "host:port|hostname", by rank 0
        probe.close()
        host, port = addr.partition("|")[0].rsplit(":", 1)
        seen = _attack(host, int(port))
        time.sleep(1.0)
    start = time.monotonic()
    dist.init_process_group("tcp", store=store, rank=rank, world_size=world_size, timeout=30)
    joined = time.monotonic() - start
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    addrs = [world().store.get(f"tandem/0/addr/{r}").decode() for r in range(world_size)]
    after = "not tried"
    if rank == 1:
        host, port = addrs[0].partition("|")[0].rsplit(":", 1)
        # the listener stays open (ranks connect on first use): a stranger is still refused
        sock = socket.create_connection((host, int(port)), timeout=5)
        try:
            _wire.client_handshake(sock, b"not-the-job-secret", TRANSPORT_PURPOSE)
            after = "accepted"
        except AuthenticationError as exc:
            after = f"AuthenticationError: {exc}"
        finally:
            sock.close()
    dist.barrier()
    dist.destroy_process_group()
    return {"sum": t.tolist(), "addrs": addrs, "seen": seen, "joined": joined, "after": after}


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: Any) -> dict[int, Any]:
    path = str(tmp_path_factory.mktemp("stranger") / "store")
    outcomes = launch(2, _stranger_during_rendezvous, (path,), init=False, timeout=40,
                      env={"MASTER_ADDR": "127.0.0.1", "TANDEM_CONNECT_TIMEOUT": "20"})
    return values(outcomes, [0, 1])


def test_job_forms_and_computes_despite_a_stranger_at_the_listener(stranger: Any) -> None:
    for rank in (0, 1):
        assert stranger[rank]["sum"] == [3.0] * 4, (rank, stranger[rank])
    assert stranger[0]["joined"] < 10.0, stranger[0]  # not held up by the idle stranger


def test_stranger_is_refused_before_anything_it_sends_is_parsed(stranger: Any) -> None:
    seen = stranger[1]["seen"]
    assert seen["wrong_secret"].startswith("AuthenticationError"), seen
    assert seen["junk"].startswith("closed") and seen["huge"].startswith("closed"), seen


def test_a_stranger_after_set_up_is_refused_and_the_job_goes_on(stranger: Any) -> None:
    assert stranger[1]["after"].startswith("AuthenticationError"), stranger[1]
    for rank in (0, 1):  # the barrier after the stranger's attempt completed
        assert stranger[rank]["sum"] == [3.0] * 4, (rank, stranger[rank])


def test_loopback_master_addr_makes_listeners_bind_loopback(stranger: Any) -> None:
    for addr in stranger[0]["addrs"]:
        assert addr.startswith("127.0.0.1:"), stranger[0]["addrs"]


def _non_loopback_ipv4() -> str | None:
    """An IPv4 address of a local interface other than loopback (Linux ioctl), if any."""
    import fcntl

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                ip = socket.inet_ntoa(fcntl.ioctl(probe.fileno(), 0x8915, req)[20:24])
            except OSError:
                continue  # no IPv4 address on this interface
            if not ip.startswith("127."):
                return ip
    finally:
        probe.close()
    return None


def _published_addresses(rank: int, world_size: int) -> list[str]:
    return [world().store.get(f"tandem/0/addr/{r}").decode() for r in range(world_size)]


HARNESS_SECRET = "tandem-test-secret"  # what tandem.testing.launch gives its children


def test_non_loopback_master_addr_binds_that_interface_not_all(monkeypatch: Any) -> None:
    ip = _non_loopback_ipv4()
    if ip is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    # the parent hosts the TCPStore with its own secret (see test_fault_harness.py)
    monkeypatch.setenv("TANDEM_SECRET", HARNESS_SECRET)
    outcomes = launch(2, _published_addresses, rendezvous="tcp", timeout=40,
                      env={"MASTER_ADDR": ip})
    for addr in values(outcomes, [0, 1])[0]:
        assert addr.startswith(f"{ip}:"), (ip, addr)



def test_bind_addr_0000_listens_everywhere_but_publishes_the_routable_address(
        monkeypatch: Any) -> None:
    ip = _non_loopback_ipv4()
    if ip is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    monkeypatch.setenv("TANDEM_SECRET", HARNESS_SECRET)
    outcomes = launch(2, _published_addresses, rendezvous="tcp", timeout=40,
                      env={"MASTER_ADDR": ip, "TANDEM_BIND_ADDR": "0.0.0.0"})
    for addr in values(outcomes, [0, 1])[0]:
        assert addr.startswith(f"{ip}:"), (ip, addr)  # peers on other hosts dial this


def test_a_wildcard_is_advertised_as_the_interface_that_routes_to_the_master() -> None:
    assert _wire.advertised_address("10.1.2.3", "10.9.9.9") == "10.1.2.3"  # bound: as is
    assert _wire.advertised_address("0.0.0.0", "127.0.0.1") == "127.0.0.1"
    ip = _non_loopback_ipv4()
    if ip is not None:
        assert _wire.advertised_address("0.0.0.0", ip) == ip
    assert not _wire.is_wildcard(_wire.advertised_address("0.0.0.0", None))
    # MASTER_ADDR=0.0.0.0 asks for every interface; the transport listens there too
    assert bind_address(Settings(), "0.0.0.0") == "0.0.0.0"
    assert not _wire.is_wildcard(_wire.advertised_address("0.0.0.0", "0.0.0.0"))


@pytest.mark.parametrize("value", ["0", "0.0", "0x0"])
def test_a_bind_addr_that_means_every_interface_unspelled_is_refused(value: str) -> None:
    # peers told to dial "0" would reach their own host
    with pytest.raises(ArgumentError, match=f"TANDEM_BIND_ADDR='{value}' means every interface"):
        bind_address(Settings(bind_addr=value), "10.9.9.9")


@pytest.mark.parametrize("value", ["abc", "-1", "1e30", "203.0.113.7", "a" * 300])
def test_a_bind_addr_this_host_cannot_listen_on_is_refused_naming_the_setting(
        value: str) -> None:
    with pytest.raises(ArgumentError) as info:
        bind_address(Settings(bind_addr=value), None)
    assert f"TANDEM_BIND_ADDR='{value}': this host cannot listen there" in str(info.value)


def test_a_bind_addr_of_this_host_is_taken_as_given() -> None:
    assert bind_address(Settings(bind_addr="127.0.0.1"), None) == "127.0.0.1"
    assert bind_address(Settings(bind_addr="localhost"), None) == "localhost"


def test_a_store_listening_on_every_interface_says_so() -> None:
    with pytest.warns(UserWarning, match="listens on every interface"):
        store = dist.TCPStore("0.0.0.0", 0, is_master=True, timeout=10, secret=b"s",
                              wait_for_workers=False)
    try:
        store.set("k", b"v")  # its own client reaches it over loopback
        assert store.get("k") == b"v"
    finally:
        store.close()


# -- the secret file ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_secret_file_other_users_can_access_is_refused(tmp_path: Any, mode: int) -> None:
    path = tmp_path / "secret"
    path.write_text("s3cret\n")
    path.chmod(mode)
    with pytest.raises(ArgumentError, match=f"{mode:04o}.*too open.*chmod 600"):
        load_secret({"TANDEM_SECRET_FILE": str(path)})


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_private_secret_file_is_read(tmp_path: Any, mode: int) -> None:
    path = tmp_path / "secret"
    path.write_text("s3cret\n")
    path.chmod(mode)
    assert load_secret({"TANDEM_SECRET_FILE": str(path)}) == b"s3cret"


def test_a_per_user_secret_file_made_readable_by_others_is_refused(
        tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    first = load_secret({})  # created private
    path = tmp_path / "tandem" / "secret"
    assert (path.stat().st_mode & 0o777) == 0o600 and load_secret({}) == first
    path.chmod(0o644)
    with pytest.raises(ArgumentError, match="too open"):
        load_secret({})


# -- the TCPStore server ------------------------------------------------------------------

SECRET = b"store-fault-test-secret"


def _closed_by_server(sock: socket.socket, within: float = 3.0) -> bool:
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except socket.timeout:
        return False
    except OSError:
        return True


def test_store_rejects_strangers_while_a_good_client_keeps_working() -> None:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=10, secret=SECRET,
                           wait_for_workers=False)
    socks: list[socket.socket] = []
    try:
        good = dist.TCPStore("127.0.0.1", master.port, timeout=10, secret=SECRET)
        got: list[bytes] = []
        blocked = threading.Thread(target=lambda: got.append(good.get("released")))
        blocked.start()  # a client parked in get() while the attacks happen

        with pytest.raises(AuthenticationError, match="secret"):
            dist.TCPStore("127.0.0.1", master.port, timeout=5, secret=b"wrong")

        def conn() -> socket.socket:
            s = socket.create_connection(("127.0.0.1", master.port), timeout=5)
            socks.append(s)
            return s

        junk = conn()
        junk.sendall(os.urandom(4096))
        huge_before_auth = conn()
        huge_before_auth.sendall(b"\xff" * 80)
        huge_after_auth = conn()
        _wire.client_handshake(huge_after_auth, SECRET, STORE_PURPOSE)
        huge_after_auth.sendall(struct.pack("!I", 0xFFFFFFFF))
        half = conn()
        half.recv(40)
        half.sendall(_wire.MAGIC + b"\x01" * 7)
        half.close()
        for _ in range(50):
            conn()  # idle: each parks a server handshake for HANDSHAKE_TIMEOUT

        start = time.monotonic()
        for i in range(20):
            good.set(f"k{i}", str(i))
        other = dist.TCPStore("127.0.0.1", master.port, timeout=10, secret=SECRET)
        assert [other.get(f"k{i}") for i in range(20)] == [str(i).encode() for i in range(20)]
        other.set("released", b"yes")
        blocked.join(5)
        assert got == [b"yes"], "the parked get() was not answered"
        assert time.monotonic() - start < 3.0, "strangers slowed down the good clients"
        for name, s in (("junk", junk), ("huge_before_auth", huge_before_auth),
                        ("huge_after_auth", huge_after_auth)):
            assert _closed_by_server(s), f"the store kept the {name} connection open"
        other.close()
        good.close()
    finally:
        for s in socks:
            s.close()
        master.close()


# -- a flood of idle strangers at the store port ----------------------------------------

FLOOD = 1100


def _start_flood(port: int, n: int, greeted: int, timeout: float) -> subprocess.Popen[str]:
    """``n`` idle strangers at ``port`` (tests/faults/_flood.py), once the server has taken
    in and challenged ``greeted`` of them."""
    flood = subprocess.Popen([sys.executable, str(Path(__file__).parent / "_flood.py"),
                              str(port), str(n)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert flood.stdout is not None
    deadline = time.monotonic() + timeout
    for line in flood.stdout:
        if int(line.split()[1]) >= greeted or time.monotonic() > deadline:
            break
    return flood


def _join_through_store(rank: int, world_size: int, port: int) -> Any:
    start = time.monotonic()
    store = dist.TCPStore("127.0.0.1", port, world_size, timeout=60)
    dist.init_process_group("tcp", store=store, rank=rank, world_size=world_size, timeout=60)
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    dist.destroy_process_group()
    store.close()
    return {"sum": t.tolist(), "formed": time.monotonic() - start}


def test_a_job_forms_while_strangers_flood_the_store_port(monkeypatch: Any) -> None:
    monkeypatch.setenv("TANDEM_SECRET", HARNESS_SECRET)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=60,
                           secret=HARNESS_SECRET, wait_for_workers=False)
    flood = _start_flood(master.port, FLOOD, greeted=1000, timeout=30)
    try:
        store_threads = [t for t in threading.enumerate() if t.name.startswith("tandem-store")]
        assert len(store_threads) < 5, f"a thread per stranger: {len(store_threads)} threads"
        outcomes = launch(2, _join_through_store, (master.port,), init=False, timeout=80)
        formed = values(outcomes, [0, 1])
    finally:
        flood.kill()
        flood.communicate(timeout=30)
        master.close()
    for rank in (0, 1):
        assert formed[rank]["sum"] == [3.0] * 4, formed
        # strangers are pushed out after EVICT_AGE, not waited out
        assert formed[rank]["formed"] < 30, formed


def _greeted(port: int) -> socket.socket:
    """A stranger the server has taken in: it received the challenge and says nothing."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    assert len(_wire.recv_exact(s, len(_wire.MAGIC) + 32)) == 40
    return s


def test_a_silent_stranger_is_dropped_at_its_handshake_deadline(monkeypatch: Any) -> None:
    monkeypatch.setattr(_gate, "PENDING_DEADLINE", 1.0)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=10, secret=SECRET,
                           wait_for_workers=False)
    try:
        start = time.monotonic()
        idle = _greeted(master.port)
        assert _closed_by_server(idle, within=10.0)
        assert 0.9 <= time.monotonic() - start < 4.0  # its own deadline, not the client's
        idle.close()
    finally:
        master.close()


def test_a_full_gate_pushes_out_its_oldest_stranger(monkeypatch: Any) -> None:
    monkeypatch.setattr(_gate, "MAX_PENDING", 4)
    monkeypatch.setattr(_gate, "EVICT_AGE", 0.2)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=10, secret=SECRET,
                           wait_for_workers=False)
    try:
        strangers = [_greeted(master.port) for _ in range(4)]
        newest = _greeted(master.port)  # taken in once the oldest is 0.2 s old
        assert _closed_by_server(strangers[0], within=5.0), "the oldest was kept"
        for s in strangers[1:]:  # the others still wait (closed only at their deadline)
            s.settimeout(0.0)
            with pytest.raises(BlockingIOError):
                s.recv(1)
        with dist.TCPStore("127.0.0.1", master.port, timeout=10, secret=SECRET) as good:
            good.set("in", b"yes")  # a rank still gets in: it pushes out the next oldest
        for s in [*strangers, newest]:
            s.close()
    finally:
        master.close()


def _connections_to(port: int) -> int:
    """How many connections to local ``port`` are established (``/proc/net/tcp``)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(1 for r in rows if int(r[1].rsplit(":", 1)[1], 16) == port and r[3] == "01")


def test_a_store_that_dies_mid_handshake_is_not_called_a_wrong_secret() -> None:
    host = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time, tandem\n"
         "s = tandem.TCPStore('127.0.0.1', 0, is_master=True, secret=b'x', "
         "wait_for_workers=False)\n"
         "print(s.port, flush=True)\n"
         "time.sleep(120)\n"], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        os.kill(host.pid, signal.SIGSTOP)  # it cannot answer: our handshake waits for it
        failed: list[BaseException] = []

        def join() -> None:
            try:
                # a server gone mid-handshake may be restarting: tried until connect_timeout
                dist.TCPStore("127.0.0.1", port, timeout=20, secret=b"x", connect_timeout=3)
            except BaseException as exc:  # noqa: BLE001 - examined below
                failed.append(exc)

        before = _connections_to(port)  # the host's own client's
        client = threading.Thread(target=join, daemon=True)
        client.start()
        # the kernel completes the connection for the stopped host: we wait in the handshake
        deadline = time.monotonic() + 20
        while _connections_to(port) <= before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _connections_to(port) > before, "the client never connected"
        os.kill(host.pid, signal.SIGKILL)
        client.join(30)
        assert not client.is_alive(), "the client did not notice the store's death"
    finally:
        host.kill()
        host.wait(30)
    assert len(failed) == 1 and isinstance(failed[0], StoreError), failed
    assert not isinstance(failed[0], AuthenticationError), failed
    assert "went away" in str(failed[0]) and "secret" not in str(failed[0]), failed


def test_a_gate_whose_listener_closed_before_it_ran_ends_quietly() -> None:
    # the owner may close the listener (a transport falling back) before the gate's
    # thread first runs: the run ends without raising in that thread
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    gate = _gate.Gate(listener, SECRET, b"test", lambda s: s.close(), name="test")
    listener.close()
    gate.run(deadline=time.monotonic() + 5.0)
