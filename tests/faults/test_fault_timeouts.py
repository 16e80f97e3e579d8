"""Stuck ranks (SIGSTOP, or a rank that never calls) end in ``CollectiveTimeoutError``.

The error names the op, the group and the rank that was not heard from (``.missing``);
a stopped child is SIGKILLed by the harness once the live ranks are done. Sending to a
stopped rank, whose socket buffers fill up, must end at the deadline too.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem as dist
from _fault_helpers import attempt, values, warm_up
from tandem.testing import launch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(90)]

OP_TIMEOUT = 3.0
LATE = 1.5  # how much later one live rank enters, so the order of timeouts is fixed
STOP_LAUNCH_DEADLINE = 16.0  # the live ranks need start-up + 9 s: 12 s failed on a loaded
# machine (the stopped rank never reports: the harness kills it once they have exited)


def _one_rank_stopped(rank: int, world_size: int, pid_file: str) -> Any:
    first = dist.new_group([0, 1, 2], group_desc="first")
    second = dist.new_group([0, 1, 2], group_desc="second")
    dist.barrier()  # everyone is connected and running
    if rank == 2:
        Path(pid_file).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        return "resumed"  # not reached: the harness SIGKILLs the stopped process
    # group 'first': rank 0 (waiting on rank 2) times out first; rank 1 learns it from rank 0
    if rank == 1:
        time.sleep(LATE)
    a = attempt(dist.all_reduce, torch.ones(4), group=first)
    # group 'second': rank 1 (waiting on rank 0, which waits on rank 2) times out first
    if rank == 0:
        time.sleep(LATE)
    b = attempt(dist.all_reduce, torch.ones(4), group=second)
    return {"first": a, "second": b}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: Any) -> tuple[dict[int, Any], list[Any], int, float]:
    pid_file = tmp_path_factory.mktemp("stop") / "pid"
    warm_up()
    start = time.monotonic()
    outcomes = launch(3, _one_rank_stopped, (str(pid_file),), timeout=STOP_LAUNCH_DEADLINE,
                      op_timeout=OP_TIMEOUT)
    took = time.monotonic() - start
    return values(outcomes, [0, 1]), outcomes, int(pid_file.read_text()), took


def test_rank_waiting_on_a_stopped_rank_times_out_naming_it(stopped: Any) -> None:
    results, _, _, _ = stopped
    r = results[0]["first"]
    assert not r["ok"] and r["type"] == "CollectiveTimeoutError", r
    assert r["missing"] == (2,), r
    for part in ("all_reduce", "'first'", "rank(s) 2"):
        assert part in r["msg"], (part, r["msg"])
    assert OP_TIMEOUT - 0.5 < r["elapsed"] < OP_TIMEOUT + 2.0, r


def test_the_timeout_reaches_the_other_live_rank_naming_the_stopped_rank(stopped: Any) -> None:
    results, _, _, _ = stopped
    r = results[1]["first"]
    assert not r["ok"] and r["type"] == "CollectiveTimeoutError", r
    for part in ("all_reduce", "'first'", "rank(s) 2"):
        assert part in r["msg"], (part, r["msg"])
    assert r["elapsed"] < OP_TIMEOUT, r  # told by rank 0, before its own deadline


def test_the_propagated_timeout_keeps_missing(stopped: Any) -> None:
    results, _, _, _ = stopped
    assert 2 in results[1]["first"]["missing"], results[1]["first"]


def test_a_rank_blocked_behind_a_live_rank_still_names_the_stopped_rank(stopped: Any) -> None:
    results, _, _, _ = stopped
    for rank in (0, 1):
        r = results[rank]["second"]
        assert r["type"] == "CollectiveTimeoutError", (rank, r)
        assert 2 in r["missing"] or "rank(s) 2" in r["msg"], (rank, r["msg"])


def test_the_harness_kills_a_stopped_rank_once_the_others_are_done(stopped: Any) -> None:
    _, outcomes, pid, took = stopped
    assert not outcomes[2].ok and outcomes[2].error == "stopped", outcomes[2]
    assert outcomes[2].exitcode == -signal.SIGKILL, outcomes[2]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped: no stopped process is left behind
    assert took < STOP_LAUNCH_DEADLINE + 8.0


def _one_rank_never_calls(rank: int, world_size: int) -> Any:
    if rank == 1:
        time.sleep(OP_TIMEOUT + 1.5)  # never joins in time, and never sends
        return {"late": attempt(dist.all_reduce, torch.ones(4))}
    buf = torch.zeros(4)
    recv_work = dist.irecv(buf, src=1)
    recv_short = attempt(recv_work.wait, timeout=0.5)
    work = dist.all_reduce(torch.ones(4), async_op=True)
    short = attempt(work.wait, timeout=0.5)
    pending = work.is_completed()
    full = attempt(work.wait)
    return {"recv_short": recv_short, "short": short, "pending_after_short": not pending,
            "full": full, "completed": work.is_completed(), "success": work.is_success()}


@pytest.fixture(scope="module")
def never_calls() -> dict[int, Any]:
    return values(launch(2, _one_rank_never_calls, timeout=30, op_timeout=OP_TIMEOUT), [0, 1])


def test_rank_that_never_calls_is_named_in_the_timeout(never_calls: Any) -> None:
    r = never_calls[0]["full"]
    assert not r["ok"] and r["type"] == "CollectiveTimeoutError", r
    assert r["missing"] == (1,), r
    for part in ("all_reduce", "'default'", "rank(s) 1"):
        assert part in r["msg"], (part, r["msg"])
    assert never_calls[0]["completed"] and not never_calls[0]["success"]


def test_work_wait_with_a_timeout_raises_before_the_op_deadline(never_calls: Any) -> None:
    r = never_calls[0]
    for key in ("recv_short", "short"):
        assert not r[key]["ok"] and r[key]["type"] == "CollectiveTimeoutError", (key, r[key])
        assert 0.4 < r[key]["elapsed"] < OP_TIMEOUT - 0.5, (key, r[key])
    assert "irecv from rank 1" in r["recv_short"]["msg"], r["recv_short"]
    assert "all_reduce" in r["short"]["msg"], r["short"]
    assert r["pending_after_short"], "a short wait must not complete the op"


def test_late_rank_finds_the_group_aborted_and_fails_fast(never_calls: Any) -> None:
    r = never_calls[1]["late"]
    assert not r["ok"] and r["type"] == "StateError", r
    assert "timed out" in r["msg"] and r["elapsed"] < OP_TIMEOUT - 0.5, r


def _send_to_stopped_peer(rank: int, world_size: int) -> Any:
    dist.barrier()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    t = torch.zeros(50_000)  # 200 KB per message: written inline from the caller's thread
    start = time.monotonic()
    if rank == 0:  # blocking sends: each one must end by its deadline
        for n in range(400):  # 80 MB: far more than the socket buffers hold
            r = attempt(dist.send, t, dst=2)
            if not r["ok"]:
                return {"error": r, "sent": n, "elapsed": time.monotonic() - start}
        return {"error": None}
    works = [dist.isend(t, dst=2) for _ in range(400)]  # must return at once, every one
    issued = time.monotonic() - start
    return {"issued_in": issued, "last": attempt(works[-1].wait)}


@pytest.fixture(scope="module")
def stopped_receiver() -> list[Any]:
    warm_up()
    # the harness's backstop only: the ops' own deadlines are what the tests check, and
    # start-up under a loaded suite took the whole of 3 x OP_TIMEOUT once
    return launch(3, _send_to_stopped_peer, timeout=30, op_timeout=OP_TIMEOUT)




def test_send_to_a_stopped_peer_ends_at_the_deadline(stopped_receiver: Any) -> None:
    r = values(stopped_receiver, [0])[0]
    assert r["error"] is not None and r["error"]["type"] == "CollectiveTimeoutError", r
    assert 2 in r["error"]["missing"] or "rank 2" in r["error"]["msg"], r


def test_isend_to_a_stopped_peer_never_blocks_and_wait_times_out(stopped_receiver: Any) -> None:
    r = values(stopped_receiver, [1])[1]
    assert r["issued_in"] < 1.0, r
    assert not r["last"]["ok"] and r["last"]["type"] == "CollectiveTimeoutError", r
