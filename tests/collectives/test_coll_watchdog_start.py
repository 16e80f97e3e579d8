"""The watchdog's thread starts while init waits for the other ranks, not after, and
not before the rank's own entry is in the store.

``Thread.start`` returns once the new thread has run: with 16 ranks on 2 CPUs that took
up to 0.1 s, at the end of every rank's init; at its beginning, it delayed the rank's
host key, which every other rank waits for. Here a one-rank job in this process
(HashStore) looks for the thread when it publishes, waits and connects.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import tandem
from tandem.collectives import watchdog, world
from tandem.collectives.watchdog import EarlyThread


def _watchdogs() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "tandem-watchdog" and t.is_alive()}


class _Watching(tandem.HashStore):
    """Records, at this rank's address and host key and at each wait for keys, the watchdog threads."""

    def __init__(self, old: set[threading.Thread]) -> None:
        super().__init__()
        self.old = old
        self.seen: list[tuple[str, set[threading.Thread]]] = []

    def _set(self, key: str, value: bytes) -> None:
        if "topology/host/" in key or "/addr/" in f"/{key}":
            self.seen.append(("publish", _watchdogs() - self.old))
        super()._set(key, value)

    def _multi_get(self, keys: list[str], deadline: float, seconds: float) -> list[bytes]:
        self.seen.append(("wait", _watchdogs() - self.old))
        return super()._multi_get(keys, deadline, seconds)


@pytest.mark.parametrize("backend, publishes", [("auto", 1), ("tcp", 2)])
def test_the_watchdog_thread_starts_after_the_rank_publishes_and_before_it_waits(
        backend: str, publishes: int, job_secret: bytes) -> None:
    """Its start (a wait for a CPU) no longer delays what every other rank waits for (its
    host key; over tcp also its address, published inside the transport, which calls init
    back in between: 16 ranks on 2 CPUs all waited 0.13 s for the slowest start), and
    still overlaps this rank's own wait for the others."""
    store = _Watching(_watchdogs())
    tandem.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        w = world._world
        assert w is not None and w.monitor is not None and w.monitor.watchdog is not None
        kinds = [k for k, _ in store.seen]
        assert kinds[:publishes + 1] == ["publish"] * publishes + ["wait"], store.seen
        assert all(started == set() for _, started in store.seen[:publishes]), (
            "the thread started before what the others wait for was set", store.seen)
        # the thread started then is the one that watches
        assert store.seen[publishes][1] == {w.monitor.watchdog._threads[0]}, store.seen
        thread = w.monitor.watchdog._threads[0]
    finally:
        tandem.destroy_process_group()
    thread.join(10)
    assert not thread.is_alive(), "the watchdog thread outlived its group"


def test_a_failed_init_ends_the_early_thread(job_secret: bytes,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    old = _watchdogs()

    def failing(*args: Any) -> Any:
        raise tandem.errors.NetworkError("nobody home")

    monkeypatch.setattr(world, "_connect", failing)
    with pytest.raises(tandem.errors.NetworkError, match="nobody home"):
        tandem.init_process_group("tcp", store=tandem.HashStore(), rank=0, world_size=1)
    for t in _watchdogs() - old:
        t.join(10)
        assert not t.is_alive(), "a failed init left its watchdog thread running"


def test_an_unclaimed_early_thread_ends_and_its_work_gets_a_thread_of_its_own() -> None:
    early = EarlyThread("tandem-test-early", 0.01)
    early.thread.join(10)
    assert not early.thread.is_alive()
    ran = threading.Event()
    t = early.run(ran.set)
    assert t is not early.thread and ran.wait(10)
    t.join(10)


def test_an_early_thread_never_started_runs_its_work_when_given_it() -> None:
    early = EarlyThread("tandem-test-early", 30, start=False)
    ran = threading.Event()
    t = early.run(ran.set)
    assert t is early.thread and ran.wait(10)
    t.join(10)
    early = EarlyThread("tandem-test-early", 30, start=False)
    early.cancel()
    early.start()  # after cancel: nothing to start
    assert not early.thread.is_alive() and early.thread.ident is None


class _StoreUse(tandem.HashStore):
    """Records when the watchdog's store thread first uses the store (its keys: watch/)."""

    def __init__(self) -> None:
        super().__init__()
        self.first_use = threading.Event()
        self.at = 0.0

    def _add(self, key: str, amount: int) -> int:
        if "watch/" in key and not self.first_use.is_set():
            self.at = time.monotonic()
            self.first_use.set()
        return super()._add(key, amount)


def test_the_store_thread_starts_at_the_watchdogs_first_tick(
        job_secret: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not at init: its start (a wait for a CPU) and its first store round trips landed in
    start-up, when every rank uses the store at once; no stall is looked for earlier."""
    tick = 0.5
    monkeypatch.setattr(watchdog, "tick_for", lambda stall_warn: tick)
    began: list[float] = []
    watch = watchdog.Watchdog._watch

    def timed(self: watchdog.Watchdog) -> None:
        began.append(time.monotonic())
        watch(self)

    monkeypatch.setattr(watchdog.Watchdog, "_watch", timed)
    store = _StoreUse()
    tandem.init_process_group("auto", store=store, rank=0, world_size=1)
    try:
        tandem.barrier()
        assert store.first_use.wait(60), "the store thread never used the store"
        assert began and store.at - began[0] >= tick, (
            f"the store thread used the store {store.at - began[0]:.3f} s after the "
            f"watchdog began, before its first tick ({tick} s)")
    finally:
        tandem.destroy_process_group()
