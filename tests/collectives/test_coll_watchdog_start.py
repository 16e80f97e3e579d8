"""The watchdog's thread starts while init waits for the other ranks, not after.

``Thread.start`` returns once the new thread has run: with 16 ranks on 2 CPUs that took
up to 0.1 s, at the end of every rank's init. Here a one-rank job in this process
(tcp, HashStore) looks for the thread while it connects.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

import tandem
from tandem.collectives import world
from tandem.collectives.watchdog import EarlyThread


def _watchdogs() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "tandem-watchdog" and t.is_alive()}


def test_the_watchdog_thread_runs_before_the_rank_connects(
        job_secret: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    old = _watchdogs()
    seen: list[set[threading.Thread]] = []
    connect = world._connect

    def connecting(*args: Any) -> Any:
        seen.append(_watchdogs() - old)
        return connect(*args)

    monkeypatch.setattr(world, "_connect", connecting)
    tandem.init_process_group("tcp", store=tandem.HashStore(), rank=0, world_size=1)
    try:
        assert len(seen) == 1 and len(seen[0]) == 1, f"watchdog threads at connect: {seen}"
        w = world._world
        assert w is not None and w.monitor is not None and w.monitor.watchdog is not None
        # the thread started early is the one that watches
        assert seen[0] == {w.monitor.watchdog._threads[0]}
    finally:
        tandem.destroy_process_group()
    for t in seen[0]:
        t.join(10)
        assert not t.is_alive(), "the watchdog thread outlived its group"


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
