"""Failures name names: timeouts, dead workers, strangers.

* a call past its timeout raises ``RpcTimeoutError`` naming the function, the worker and
  the time waited (``rpc_sync``, ``rpc_async``, ``remote``, and the default rpc_timeout);
* a worker that dies fails every call pending on it within seconds, naming it, instead
  of at the calls' 60-second deadline;
* a worker with the wrong job secret cannot join.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import tandem.rpc as rpc
from _rpc_workers import attempt, echo, run, run_outcomes, sleep_then, start
from tandem.testing import launch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]


def _timeouts(rank: int, world: int) -> dict[str, Any]:
    r: dict[str, Any] = {}
    if rank == 0:
        r["sync"] = attempt(rpc.rpc_sync, "worker1", sleep_then, args=(3.0,), timeout=0.5)
        fut = rpc.rpc_async("worker1", sleep_then, args=(3.0,), timeout=0.5)
        r["async"] = attempt(fut.wait)
        rref = rpc.remote("worker1", sleep_then, args=(3.0,), timeout=0.5)
        time.sleep(1.0)
        r["remote"] = attempt(rref.to_here)
        r["default"] = attempt(rpc.rpc_sync, "worker1", sleep_then, args=(3.0,))
        r["fine"] = rpc.rpc_sync("worker1", sleep_then, args=(0.1, "ok"), timeout=5)
    # the timed-out calls still sleep on worker1: a graceful shutdown waits for them, and
    # the default bound for that (rpc_timeout, 1.5 s here) is tight on a loaded machine
    rpc.shutdown(timeout=30)
    return r


@pytest.fixture(scope="module")
def timeouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run(2, _timeouts, tmp_path_factory.mktemp("timeouts"), rpc_timeout=1.5,
               num_worker_threads=4)[0]


@pytest.mark.parametrize("case", ["sync", "async"])
def test_a_call_past_its_timeout_names_function_worker_and_time(timeouts: dict[str, Any],
                                                                  case: str) -> None:
    err = timeouts[case]
    assert err["type"] == "RpcTimeoutError", err
    assert "TimeoutError" in err["types"] and "RuntimeError" in err["types"], err["types"]
    assert "sleep_then" in err["msg"] and "'worker1'" in err["msg"], err["msg"]
    assert "timeout 0.5 s" in err["msg"], err["msg"]
    assert 0.4 < err["elapsed"] < 2.0, err


def test_remote_past_its_timeout_fails_at_the_next_use(timeouts: dict[str, Any]) -> None:
    err = timeouts["remote"]
    assert err["type"] == "RpcTimeoutError" and "remote(" in err["msg"], err


def _remote_with_a_stalled_watch(rank: int, world: int) -> dict[str, Any]:
    r: dict[str, Any] = {}
    if rank == 0:
        from tandem.rpc import _state
        monitor = _state.require("test").monitor
        assert monitor is not None
        watch = monitor.round
        monitor.round = lambda: None  # as if the watch thread got no CPU on a busy machine
        rref = rpc.remote("worker1", sleep_then, args=(3.0,), timeout=0.5)
        time.sleep(1.0)
        r["remote"] = attempt(rref.to_here)
        monitor.round = watch  # type: ignore[method-assign]
    rpc.shutdown(timeout=30)
    return r


def test_a_remote_past_its_timeout_fails_at_its_use_without_the_watch_thread(
        tmp_path: Path) -> None:
    err = run(2, _remote_with_a_stalled_watch, tmp_path, rpc_timeout=5.0)[0]["remote"]
    assert err["type"] == "RpcTimeoutError" and "remote(" in err["msg"], err
    assert err["elapsed"] < 1.0, err  # at once, not after to_here's own 5 s


def test_the_default_timeout_is_the_rpc_timeout_option(timeouts: dict[str, Any]) -> None:
    err = timeouts["default"]
    assert err["type"] == "RpcTimeoutError" and "timeout 1.5 s" in err["msg"], err
    assert timeouts["fine"] == "ok"


def _die_soon(delay: float) -> None:
    def kill() -> None:
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=kill, daemon=True).start()


def _dead_worker(rank: int, world: int) -> dict[str, Any]:
    if rank == 1:
        time.sleep(60)  # killed long before
        return {}
    pending = [rpc.rpc_async("worker1", sleep_then, args=(30.0,)) for _ in range(3)]
    sync: dict[str, Any] = {}
    t = threading.Thread(target=lambda: sync.update(
        attempt(rpc.rpc_sync, "worker1", sleep_then, args=(30.0,))))
    t.start()
    rpc.rpc_sync("worker1", _die_soon, args=(0.5,))
    waited = [attempt(f.wait) for f in pending]
    t.join(30)
    after = attempt(rpc.rpc_sync, "worker1", echo, args=(1,))
    shutdown = attempt(rpc.shutdown)
    return {"futures": waited, "sync": sync, "after": after, "shutdown": shutdown}


def test_a_dead_worker_fails_pending_calls_within_seconds_naming_it(tmp_path: Path) -> None:
    out = run_outcomes(2, _dead_worker, tmp_path, timeout=60)
    assert out[1].exitcode == -signal.SIGKILL, out[1]
    assert out[0].ok, out[0].error
    r = out[0].value
    for err in r["futures"] + [r["sync"]]:
        assert err["type"] == "PeerLostError" and err["rank"] == 1, err
        assert "'worker1'" in err["msg"] and "sleep_then" in err["msg"], err["msg"]
        assert err["elapsed"] < 5.0, err  # not the 60-second rpc_timeout
    assert r["after"]["type"] == "PeerLostError" and "'worker1'" in r["after"]["msg"], r["after"]
    assert r["shutdown"]["type"] == "PeerLostError", r["shutdown"]


def _wrong_secret(rank: int, world: int, store: str) -> dict[str, Any]:
    if rank == 1:
        os.environ["TANDEM_SECRET"] = "not-the-job-secret"
    return attempt(start, rank, world, store)


def test_a_worker_with_the_wrong_secret_cannot_join(tmp_path: Path) -> None:
    out = launch(2, _wrong_secret, args=(str(tmp_path / "store"),), init=False, timeout=60,
                 env={"TANDEM_CONNECT_TIMEOUT": "3"})
    stranger, host = out[1].value, out[0].value
    assert stranger["type"] == "AuthenticationError", stranger
    assert not host["ok"] and "rank(s) [1] did not connect" in host["msg"], host
