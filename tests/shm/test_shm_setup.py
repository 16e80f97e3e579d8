"""Rendezvous of the shm backend: one host only, authenticated peers, sleeping waiters."""

from __future__ import annotations

from typing import Any

import pytest

from _shm_fault_ranks import (handshakes_at_init, hosts_differ, idle_waiter_cpu, mismatched,
                              named_gloo, stranger_knocks)
from tandem.collectives import backend as backend_module
from tandem.collectives.backend import BackendOptions, resolve_backend
from tandem.config import Settings
from tandem.errors import ArgumentError
from tandem.store.hash import HashStore
from tandem.testing import launch, spawn
from tandem.transport.mixed import host_key, require_one_host
from tandem.transport.tcp import TcpTransport

pytestmark = pytest.mark.timeout(120)


@pytest.mark.procs
def test_shm_across_hosts_fails_on_every_rank_naming_the_hosts(tmp_path: Any) -> None:
    outcomes = launch(2, hosts_differ, (str(tmp_path / "store"),), init=False, timeout=60)
    for o in outcomes:
        r = o.value
        assert not r["ok"] and r["type"] == "ArgumentError", (o.rank, r)
        assert "'node-0' has rank(s) [0]" in r["msg"] and "'node-1' has rank(s) [1]" in r["msg"]
        assert "auto" in r["msg"], r["msg"]


def test_machines_sharing_a_host_name_are_told_apart_by_boot_id() -> None:
    with pytest.raises(ArgumentError, match="boot ids or namespaces differ"):
        require_one_host(["box|boot-1|net:[1]", "box|boot-2|net:[1]"])
    require_one_host([host_key("box"), host_key("box")])


def test_the_boot_id_is_read_once_at_import_the_namespace_every_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker forked from a process that imported tandem reads no file for its host key
    (the boot id is the machine's); the namespace is looked up each time, as a process
    may enter another one after import."""
    import builtins
    import os

    before = host_key("box")

    def no_files(*args: Any, **kwargs: Any) -> Any:
        raise OSError("no file may be opened for a host key")

    monkeypatch.setattr(builtins, "open", no_files)
    assert host_key("box") == before
    monkeypatch.setattr(os, "readlink", lambda path: "net:[elsewhere]")
    assert host_key("box") != before and host_key("box").endswith("net:[elsewhere]")


def test_shm_is_a_known_backend_name() -> None:
    assert resolve_backend("shm") == "shm"
    assert resolve_backend("SHM") == "shm"


@pytest.mark.procs
def test_torch_s_gloo_name_gets_shared_memory_on_one_host(tmp_path: Any) -> None:
    # a script ported by changing its imports keeps init_process_group("gloo"): it must get
    # the same-host fast path, not loopback tcp
    assert resolve_backend("gloo") == resolve_backend("cpu:gloo,cuda:nccl") == "auto"
    for r in spawn(2, named_gloo, (str(tmp_path / "store"),), init=False, timeout=60):
        assert r == {"transport": "ShmTransport", "sum": 1.0}, r


def _options(world_size: int = 1) -> BackendOptions:
    return BackendOptions(store=HashStore(), rank=0, world_size=world_size, host="127.0.0.1",
                          hostname="h", secret=b"s", settings=Settings())


def test_unsupported_machines_refuse_shm_and_auto_falls_back_to_tcp(monkeypatch: Any) -> None:
    monkeypatch.setattr(backend_module, "unsupported_reason", lambda: "it needs Vulcan CPUs")
    with pytest.raises(ArgumentError, match="Vulcan"):
        backend_module._shm(_options())
    t = backend_module._auto(_options())
    try:
        assert isinstance(t, TcpTransport)
    finally:
        t.close()


@pytest.mark.procs
def test_a_stranger_at_the_socket_is_rejected_and_the_job_runs(tmp_path: Any) -> None:
    r0, r1 = spawn(2, stranger_knocks, (str(tmp_path / "store"),), init=False, timeout=60)
    assert r0["sum"] == r1["sum"] == 1.0
    junk, wrong_secret = r1["knocks"]
    assert junk == "closed after 40 bytes", junk  # the challenge (magic + nonce), then EOF
    assert wrong_secret == "rejected: AuthenticationError", wrong_secret


@pytest.mark.procs
def test_ranks_waiting_for_a_late_peer_sleep_instead_of_spinning(tmp_path: Any) -> None:
    # 4 ranks on (here) 2 cores: ranks 1-3 wait ~2 s for rank 0 inside an all_reduce
    results = spawn(4, idle_waiter_cpu, (str(tmp_path / "store"),), init=False, timeout=60)
    for rank, r in enumerate(results[1:], start=1):
        assert r["wall"] > 1.0, (rank, r)
        assert r["cpu"] < 0.25 * r["wall"], f"rank {rank} burnt {r['cpu']:.2f}s CPU waiting {r['wall']:.2f}s"


@pytest.mark.procs
def test_mismatched_collectives_over_shm_fail_on_both_ranks_untouched(tmp_path: Any) -> None:
    r0, r1 = spawn(2, mismatched, (str(tmp_path / "store"),), init=False, timeout=60)
    assert not r0["ok"] and r0["type"] == "CollectiveMismatchError", r0
    assert "all_reduce" in r0["msg"] and "broadcast" in r0["msg"], r0["msg"]
    assert r0["tensor"] == [1.0] * 8, "rank 0 combined data from a mismatched call"
    later = r1["later"]  # the root sent without receiving; it learns at its next call
    assert not later["ok"] and later["type"] in ("CollectiveMismatchError", "StateError"), later
    assert "mismatch" in later["msg"], later


@pytest.mark.procs
def test_one_host_of_six_ranks_makes_five_handshakes_and_a_socket_per_pair(tmp_path: Any
                                                                          ) -> None:
    # every rank proves the secret to the host's first rank only, which hands every other
    # pair a socket of its own: R - 1 handshakes per host, not R (R - 1) / 2 (at 32 ranks,
    # 496 handshakes took most of start-up)
    p = 6
    results = spawn(p, handshakes_at_init, (str(tmp_path / "store"),), init=False, timeout=90)
    assert [r["handshakes"] for r in results] == [0] + [1] * (p - 1), results
    for rank, r in enumerate(results):
        assert r["peers"] == [q for q in range(p) if q != rank], (rank, r)
        assert r["sum"] == p, (rank, r)
    assert results[2]["got"] == [7.0] * 4, results[2]  # over the socket rank 0 handed out
    # init starts two threads on every rank, the first one included (the shm watcher and
    # the watchdog, which starts its store thread itself): a thread start waits for the
    # thread to run, 10-30 ms each with 32 ranks on 2 CPUs
    started = [r["threads_started"] for r in results]
    assert [len(s) for s in started] == [2] * p, started
