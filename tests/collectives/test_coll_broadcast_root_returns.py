"""A broadcast's root across hosts returns once its data is sent; its root check (the
other hosts' confirmations) completes by the end of its next call on the group.

Each call must still give every rank the root's bytes (the naive oracle) while the
root overwrites its buffer the moment its call returns, and the root must return
while a rank of another host has not yet entered the call. Ranks that disagree on the
root after the root returned must fail in their call (never by the deadline), and the
root's next call, or its ``destroy_process_group``, must fail naming the broadcast (its
sequence number and call site); tearing down after the group's own abort or a lost
peer must not raise.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem
from tandem.collectives.group import ProcessGroup
from tandem.errors import StateError, TandemError
from tandem.testing import launch, run_threads, stay_until_reported, wait_until

from _coll_util import join_on_host, leave_hosts

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

HOSTS = "aaaabbbb"
OP_TIMEOUT = 60.0  # a root check that waits for a rank held back ends with this
GARBAGE = -1.0  # what a root writes over its buffer right after its call returns


def _value(call: int, root: int, n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float32) * 3 + call * 1000 + root) % 4093


def _calls() -> list[tuple[int, int]]:
    # (floats, root): 4 KB in one piece, 300,001 floats in several link pieces and
    # several rounds of 64 KiB staging halves; roots a leader, inside a host, elsewhere
    return [(1024, 0)] * 6 + [(300_001, 0), (1024, 2), (1024, 0), (300_001, 5),
                              (1024, 4), (1024, 0), (300_001, 2), (1024, 0), (1024, 0)]


def _in_a_row(rank: int, p: int, store: str) -> list[str]:
    """Every call of :func:`_calls`; what differed from the root's bytes, by call. Host b
    enters call 1 only once the root's call 1 returned (a marker file)."""
    join_on_host(rank, p, HOSTS, store, False, OP_TIMEOUT)
    try:
        wrong = []
        bufs: dict[int, torch.Tensor] = {}
        for call, (n, root) in enumerate(_calls()):
            returned = Path(store) / f"returned-{call}"
            if call == 1 and HOSTS[rank] == "b":
                wait_until(returned.exists, "the root's call 1 to return", OP_TIMEOUT)
            buf = bufs.setdefault(n, torch.empty(n))  # one buffer per size, reused
            if rank == root:
                buf.copy_(_value(call, root, n))
            else:
                buf.fill_(float("nan"))
            tandem.broadcast(buf, src=root)
            if rank == root:
                returned.touch()
                buf.fill_(GARBAGE)  # its buffer is its own again: receivers must not see this
            elif not torch.equal(buf, _value(call, root, n)):
                wrong.append(f"call {call} (n={n}, root={root}): not the root's bytes")
        tandem.barrier()  # the last call's root check completes in here
        return wrong
    finally:
        leave_hosts(False)


def test_a_root_that_returns_early_and_reuses_its_buffer_gives_every_rank_its_bytes(
        tmp_path: Any) -> None:
    env = {"TANDEM_SHM_CHUNK": "65536"}  # staging halves of 64 KiB: many rounds per call
    outcomes = launch(len(HOSTS), _in_a_row, (str(tmp_path),), init=False, timeout=250,
                      env=env)
    bad = {o.rank: (o.value if o.ok else o.error[-2000:]) for o in outcomes
           if not o.ok or o.value}
    assert not bad, bad


def test_over_messages_a_root_that_reuses_its_buffer_gives_every_rank_its_bytes() -> None:
    # ranks as threads on the loopback transport: every hop is a message (no arena)
    hosts = list("aaabbbcc")
    calls = [(1024, 0)] * 8 + [(70_001, 0), (1024, 4), (1024, 0), (70_001, 7), (1024, 0)]

    def body(group: ProcessGroup) -> list[str]:
        wrong = []
        bufs: dict[int, torch.Tensor] = {}
        for call, (n, root) in enumerate(calls):
            buf = bufs.setdefault(n, torch.empty(n))
            if group.rank() == root:
                buf.copy_(_value(call, root, n))
            tandem.broadcast(buf, src=root, group=group)
            if group.rank() == root:
                buf.fill_(GARBAGE)
            elif not torch.equal(buf, _value(call, root, n)):
                wrong.append(f"call {call} (n={n}, root={root}): not the root's bytes")
        tandem.barrier(group=group)
        return wrong

    results = run_threads(len(hosts), body, hosts=hosts, timeout=250, op_timeout=120)
    assert results == [[]] * len(hosts)


def _disagree_after_return(rank: int, p: int, store: str, then: str) -> dict[str, Any]:
    """Host a broadcasts from rank 0; host b, once rank 0's call returned, from rank 5.
    What each rank's broadcast and next call did (``then``; for "destroy", rank 0 destroys
    and the others call a barrier), and the broadcast's sequence number and call site."""
    from tandem.collectives.world import world

    join_on_host(rank, p, HOSTS, store, False, OP_TIMEOUT)
    out: dict[str, Any] = {}
    try:
        tandem.broadcast(torch.zeros(1024), src=0)  # the host arenas exist
        returned = Path(store) / "root-returned"
        src = 0 if HOSTS[rank] == "a" else 5
        if src == 5:
            wait_until(returned.exists, "the root's broadcast to return", OP_TIMEOUT)
        t0 = time.monotonic()
        frame = inspect.currentframe()
        assert frame is not None
        try:
            out["site"] = f"{os.path.basename(__file__)}:{frame.f_lineno + 1}"  # the next line
            tandem.broadcast(torch.full((1024,), float(rank)), src=src)
            out["broadcast"] = "returned"
            out["seq"] = world().default._seq - 1
        except Exception as exc:  # noqa: BLE001 - the outcome is what is tested
            out["broadcast"] = f"{type(exc).__name__}: {exc}"
        out["seconds"] = time.monotonic() - t0
        if rank == 0:
            returned.touch()
        if out["broadcast"] == "returned":
            try:
                if then == "broadcast":
                    tandem.broadcast(torch.zeros(1024), src=0)
                elif then == "destroy" and rank == 0:
                    tandem.destroy_process_group()
                else:
                    tandem.barrier()
                out["then"] = "returned"
                if rank != 0:  # a reader's next broadcast may complete (the root staged it)
                    tandem.barrier()
            except Exception as exc:  # noqa: BLE001 - the outcome is what is tested
                out["then"] = f"{type(exc).__name__}: {exc}"
        out["seconds"] = time.monotonic() - t0
        return out
    finally:
        # host b learns of the abort in its call, not of the root's departure
        stay_until_reported(store, rank, range(p), OP_TIMEOUT)
        if tandem.is_initialized():
            try:
                leave_hosts(False)
            except Exception:  # noqa: BLE001 - reported by `then` where it is tested
                pass


@pytest.mark.parametrize("then", ["barrier", "broadcast", "destroy"])
def test_a_disagreement_found_after_the_root_returned_fails_its_next_step(
        then: str, tmp_path: Any) -> None:
    outcomes = launch(len(HOSTS), _disagree_after_return, (str(tmp_path), then), init=False,
                      timeout=OP_TIMEOUT + 120)
    assert all(o.ok for o in outcomes), [o.error[-2000:] for o in outcomes if not o.ok]
    seen = {o.rank: o.value for o in outcomes}
    root = seen[0]
    # the root returned before host b even entered the call
    assert root["broadcast"] == "returned", root
    # its next step fails naming the broadcast: its sequence number and call site
    assert "mismatch" in root["then"], root
    assert f"sequence {root['seq']}" in root["then"], root
    assert root["site"] in root["then"], root
    for r in range(1, len(HOSTS)):
        mine = seen[r]
        if HOSTS[r] == "a":  # readers of rank 0's arena: their call completes
            assert mine["broadcast"] == "returned", (r, mine)
        # a rank fails in the call, or, if its own part completed, in its next ones; never
        # by the deadline
        failed = mine["broadcast"] if mine["broadcast"] != "returned" else mine["then"]
        assert "mismatch" in failed or "aborted" in failed, (r, mine)
        assert "Timeout" not in failed, (r, mine)
        assert mine["seconds"] < OP_TIMEOUT / 2, (r, mine)
    # host b's leader takes rank 0's data and cannot complete: it fails in the call
    assert seen[HOSTS.index("b")]["broadcast"] != "returned", seen[HOSTS.index("b")]


def _close_after_return(group: ProcessGroup, returned: threading.Event, how: str) -> str:
    """Ranks as threads, hosts a and b: rank 0 broadcasts from itself and returns; host b
    then calls with another root ("disagree") or with rank 0 after rank 0 aborted the
    group itself ("own-abort"). What rank 0's ``close`` raised, or "closed"."""
    r = group.rank()
    if r >= 2:
        assert returned.wait(OP_TIMEOUT), "rank 0's broadcast never returned"
    try:
        tandem.broadcast(torch.zeros(4), src=0 if how == "own-abort" or r < 2 else 3,
                         group=group)
    except TandemError:
        if r == 0:
            raise
    if r != 0:
        return ""
    if how == "own-abort":  # torch's abort, an elastic regroup: nothing to report at close
        group.abort(StateError("aborted by the test"))
    returned.set()
    try:
        group.close()
    except TandemError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "closed"


def test_closing_after_the_root_returned_raises_a_disagreement_only() -> None:
    hosts = list("aabb")
    seen = run_threads(len(hosts), _close_after_return, (threading.Event(), "disagree"),
                       hosts=hosts, timeout=OP_TIMEOUT + 30, op_timeout=OP_TIMEOUT)
    assert "CollectiveMismatchError" in seen[0] and "sequence 0" in seen[0], seen[0]
    assert "test_coll_broadcast_root_returns.py:" in seen[0], seen[0]
    seen = run_threads(len(hosts), _close_after_return, (threading.Event(), "own-abort"),
                       hosts=hosts, timeout=OP_TIMEOUT + 30, op_timeout=OP_TIMEOUT)
    assert seen[0] == "closed", seen[0]


HELD = 20.0  # how long host b holds back for rank 0's warning before it goes on anyway


class _Warnings(logging.Handler):
    """tandem's warnings about a close waiting for confirmations; ``seen`` once one came."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.texts: list[str] = []
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "to confirm" in text:
            self.texts.append(text)
            self.seen.set()


def _close_while_host_b_holds_back(group: ProcessGroup, warned: threading.Event) -> None:
    """Rank 0 broadcasts from itself, returns and closes its group; host b enters the
    broadcast only once rank 0's close warned (or, without a warning, after ``HELD``)."""
    if group.rank() >= 2:
        warned.wait(HELD)
    tandem.broadcast(torch.zeros(4), src=0, group=group)
    if group.rank() == 0:
        group.close()


def test_a_close_that_waits_for_a_confirmation_names_the_rank_it_waits_for() -> None:
    from tandem.config import Settings

    warnings = _Warnings()
    logger = logging.getLogger("tandem")
    logger.addHandler(warnings)
    try:
        run_threads(4, _close_while_host_b_holds_back, (warnings.seen,), hosts=list("aabb"),
                    timeout=OP_TIMEOUT + 30, op_timeout=OP_TIMEOUT,
                    settings=Settings(stall_warn=0.2))
    finally:
        logger.removeHandler(warnings)
    assert warnings.texts, "rank 0's close waited for host b without naming it"
    text = warnings.texts[0]
    assert "rank 0 is closing group 'threads'" in text, text
    assert "rank(s) [2] to confirm broadcast #0" in text, text
    assert "test_coll_broadcast_root_returns.py:" in text, text
