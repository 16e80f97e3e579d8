"""Workers that leave or stop: nobody waits out a deadline for an answer that cannot come.

* a worker that left (``shutdown(graceful=False)``) fails the calls in flight to it as
  it goes, and every later ``rpc_sync``, ``rpc_async`` and ``remote`` to it at once,
  saying that it left and naming it (as a killed worker's calls fail at once);
* a graceful ``shutdown()`` whose peer is stopped (SIGSTOP), so never arrives, ends
  after the peer has not answered for the rpc_timeout, naming it.
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
from _rpc_workers import attempt, echo, run_outcomes
from tandem._proc import process_stopped

pytestmark = [pytest.mark.timeout(150), pytest.mark.procs]

RPC_TIMEOUT = 30.0  # what a call to a departed worker used to wait
FAST = 5.0  # seconds within which such a call must fail instead


def _wait_for(path: Path, seconds: float) -> None:
    end = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < end, f"{path.name} did not appear within {seconds} s"
        time.sleep(0.01)


def _hold(started: str, release: str) -> None:
    """Served on worker1: says it runs, then holds its call until told (or 60 s)."""
    Path(started).write_text("1")
    _wait_for(Path(release), 60.0)


def _departed(rank: int, world: int, tmp: str) -> dict[str, Any]:
    d = Path(tmp)
    if rank == 1:
        for name in ("started-sync", "started-async"):
            _wait_for(d / name, 60.0)
        rpc.shutdown(graceful=False)
        (d / "left").write_text(repr(time.time()))
        _wait_for(d / "done", 120.0)  # the process lives on; only its RPC left
        return {}
    out: dict[str, Any] = {}
    fut = rpc.rpc_async("worker1", _hold, args=(str(d / "started-async"), str(d / "done")))
    sync = threading.Thread(target=lambda: out.update(inflight_sync=attempt(
        rpc.rpc_sync, "worker1", _hold, args=(str(d / "started-sync"), str(d / "done")))))
    sync.start()
    out["inflight_async"] = attempt(fut.wait)
    sync.join(RPC_TIMEOUT + 10)
    _wait_for(d / "left", 60.0)
    out["left_at"] = float((d / "left").read_text())
    out["rpc_sync"] = attempt(rpc.rpc_sync, "worker1", echo, args=(1,))
    out["rpc_async"] = attempt(lambda: rpc.rpc_async("worker1", echo, args=(1,)).wait())
    out["remote"] = attempt(lambda: rpc.remote("worker1", echo, args=(1,)).to_here())
    (d / "done").write_text("1")
    rpc.shutdown(graceful=False)
    return out


@pytest.fixture(scope="module")
def departed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("departed")
    out = run_outcomes(2, _departed, tmp, str(tmp), timeout=130, rpc_timeout=RPC_TIMEOUT)
    assert out[0].ok and out[1].ok, (out[0].error, out[1].error)
    return dict(out[0].value)


def _says_worker1_left(err: dict[str, Any]) -> None:
    assert err["type"] == "PeerLostError" and err["rank"] == 1, err
    assert "'worker1'" in err["msg"] and "left" in err["msg"], err["msg"]
    assert "shutdown" in err["msg"], err["msg"]


@pytest.mark.parametrize("kind", ["rpc_sync", "rpc_async", "remote"])
def test_a_call_to_a_worker_that_left_fails_at_once_saying_so(departed: dict[str, Any],
                                                              kind: str) -> None:
    err = departed[kind]
    _says_worker1_left(err)
    assert err["elapsed"] < FAST, f"{kind} took {err['elapsed']:.1f} s, not the rpc_timeout"


@pytest.mark.parametrize("kind", ["inflight_sync", "inflight_async"])
def test_calls_in_flight_fail_when_their_worker_leaves(departed: dict[str, Any],
                                                       kind: str) -> None:
    err = departed[kind]
    _says_worker1_left(err)
    assert "_hold" in err["msg"], err["msg"]
    # counted from the moment worker1's shutdown returned (it waits for its own pool first)
    assert err["at"] - departed["left_at"] < FAST, (err, departed["left_at"])


def _stopped_peer(rank: int, world: int, tmp: str) -> dict[str, Any]:
    d = Path(tmp)
    if rank == 1:
        (d / "pid").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # never resumed: the harness kills it
        return {}
    _wait_for(d / "pid", 60.0)
    pid = int((d / "pid").read_text())
    end = time.monotonic() + 60.0
    while not process_stopped(pid):
        assert time.monotonic() < end, "worker1 did not stop within 60 s"
        time.sleep(0.01)
    return attempt(rpc.shutdown)


def test_shutdown_with_a_stopped_peer_ends_naming_it(tmp_path: Path) -> None:
    timeout = 3.0
    out = run_outcomes(2, _stopped_peer, tmp_path, str(tmp_path), timeout=90,
                       rpc_timeout=timeout)
    assert out[0].ok, out[0].error
    err = out[0].value
    assert err["type"] == "RpcTimeoutError", err
    assert "'worker1'" in err["msg"] and "did not answer" in err["msg"], err["msg"]
    assert "stopped" in err["msg"], err["msg"]
    # the rpc_timeout of its liveness check, then up to a poll round and a watch round
    assert timeout <= err["elapsed"] < timeout + 20.0, err
