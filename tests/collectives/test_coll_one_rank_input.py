"""Bad input on one rank only: every rank fails at once, with the same message naming it.

all_to_all splits that disagree across ranks, objects the source cannot pickle, and
sends nobody received when the group closes.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

import pytest
import torch

import tandem
from tandem.testing import run_threads
from tandem.testing.logs import capture_logs

pytestmark = pytest.mark.timeout(60)


def _outcome(call: Any) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return type(exc).__name__, str(exc)
    return "ok", ""


# -- all_to_all splits -------------------------------------------------------------------
@pytest.mark.parametrize("ws", [2, 3])
def test_all_to_all_single_splits_that_disagree_fail_on_every_rank_naming_both(ws: int) -> None:
    def body(g):
        r = g.rank()
        inp = torch.arange(2.0 * ws) + 100 * r
        out = torch.full((2 * ws,), -1.0)
        ins = [2] * ws if r != ws - 1 else [1, 3] + [2] * (ws - 2)  # the last rank is wrong
        got = _outcome(lambda: tandem.all_to_all_single(out, inp, [2] * ws, ins, group=g))
        return got, out.tolist()

    results = run_threads(ws, body, op_timeout=20)
    last = ws - 1
    # a rank may get a peer's relayed report before its own check ends: the same text, prefixed
    first = re.sub(r"^\[reported by rank \d+\] ", "", results[0][0][1])
    for rank, ((kind, text), out) in enumerate(results):
        assert kind == "CollectiveMismatchError", f"rank {rank}: {kind}: {text}"
        assert re.sub(r"^\[reported by rank \d+\] ", "", text) == first, \
            f"rank {rank} says something else: {text}"
        assert f"input_split_sizes={[1, 3] + [2] * (ws - 2)} on rank {last}" in text, text
        assert f"output_split_sizes={[2] * ws} on rank 0" in text, text
        assert out == [-1.0] * (2 * ws), f"rank {rank}: data moved before the check: {out}"


def test_all_to_all_single_row_sizes_that_disagree_are_named() -> None:
    def body(g):
        r = g.rank()
        cols = 2 if r == 0 else 1
        inp, out = torch.zeros(4, cols), torch.zeros(4, cols)
        return _outcome(lambda: tandem.all_to_all_single(out, inp, group=g))

    for rank, (kind, text) in enumerate(run_threads(2, body, op_timeout=20)):
        assert kind == "CollectiveMismatchError", f"rank {rank}: {kind}: {text}"
        assert "rows of 2 elements on rank 0, 1 on rank 1" in text, text


def test_all_to_all_list_sizes_that_disagree_fail_on_every_rank() -> None:
    def body(g):
        r = g.rank()
        ins = [torch.zeros(2), torch.zeros(2)]
        if r == 1:  # its piece for rank 0 is larger than rank 0's slot for it
            ins[0] = torch.zeros(3)
        outs = [torch.zeros(2), torch.zeros(2)]
        return _outcome(lambda: tandem.all_to_all(outs, ins, group=g))

    results = run_threads(2, body, op_timeout=20)
    for rank, (kind, text) in enumerate(results):
        assert kind == "CollectiveMismatchError", f"rank {rank}: {kind}: {text}"
        assert "sends rank" in text and "on rank 1" in text, text
    assert results[0] == results[1]


def test_all_to_all_with_consistent_uneven_splits_still_works() -> None:
    def body(g):
        r = g.rank()
        # rank 0 sends 1 row to itself, 3 to rank 1; rank 1 sends 2 to rank 0, 1 to itself
        ins = [[1, 3], [2, 1]][r]
        outs = [[1, 2], [3, 1]][r]
        inp = torch.arange(float(sum(ins))) + 10 * r
        out = torch.zeros(sum(outs))
        tandem.all_to_all_single(out, inp, outs, ins, group=g)
        return out.tolist()

    assert run_threads(2, body) == [[0.0, 10.0, 11.0], [1.0, 2.0, 3.0, 12.0]]


# -- objects that cannot be pickled ------------------------------------------------------
_LOCK = threading.Lock()  # a lock cannot be pickled
_WHY = "cannot pickle '_thread.lock' object"
OBJECT_CALLS = {
    "broadcast_object_list": (0, lambda g, r: tandem.broadcast_object_list(
        [1, _LOCK] if r == 0 else [None, None], 0, group=g), "object_list[1]"),
    "scatter_object_list": (0, lambda g, r: tandem.scatter_object_list(
        [None], [1, _LOCK] if r == 0 else None, 0, group=g), "scatter_object_input_list[1]"),
    "all_gather_object": (1, lambda g, r: tandem.all_gather_object(
        [None, None], _LOCK if r == 1 else 5, group=g), "obj"),
    "gather_object": (1, lambda g, r: tandem.gather_object(
        _LOCK if r == 1 else 5, [None, None] if r == 0 else None, 0, group=g), "obj"),
    "send_object_list": (0, lambda g, r: tandem.send_object_list([_LOCK], 1, group=g) if r == 0
                         else tandem.recv_object_list([None], 0, group=g), "object_list[0]"),
}


@pytest.mark.parametrize("name", list(OBJECT_CALLS))
def test_an_unpicklable_object_is_named_on_every_rank(name: str) -> None:
    culprit, call, entry = OBJECT_CALLS[name]

    def body(g):
        r = g.rank()
        failed = _outcome(lambda: call(g, r))
        # the group is still in step: the next object call works
        after = [r] if r == 0 else [None]
        tandem.broadcast_object_list(after, 0, group=g)
        return failed, after

    for rank, ((kind, text), after) in enumerate(run_threads(2, body, op_timeout=20)):
        assert kind == "ArgumentError", f"rank {rank}: {name} raised {kind}: {text}"
        assert f"{name}: {entry}" in text and f"on rank {culprit} could not be pickled" in text, \
            f"rank {rank}: {text}"
        assert _WHY in text, f"rank {rank}: the reason is missing: {text}"
        assert after == [0], f"rank {rank}: the next call gave {after}"


def test_the_rank_that_failed_to_pickle_keeps_the_cause() -> None:
    def body(g):
        r = g.rank()
        try:
            tandem.all_gather_object([None, None], _LOCK if r == 0 else 1, group=g)
        except Exception as exc:  # noqa: BLE001
            return type(exc.__cause__).__name__
        return "ok"

    assert run_threads(2, body, op_timeout=20) == ["TypeError", "NoneType"]


# -- sends nobody received -------------------------------------------------------------------
def _unreceived(rank: int, world_size: int) -> list[str]:
    logged = capture_logs("no receive took")
    if rank == 0:
        tandem.isend(torch.ones(4), 1, tag=5).wait()  # 16 bytes nobody receives
        for _ in range(2):
            tandem.isend(torch.ones(2, dtype=torch.float64), 1, tag=7).wait()
        tandem.send(torch.ones(1), 1, tag=9)
    elif rank == 1:
        tandem.recv(torch.empty(2, dtype=torch.float64), 0, tag=7)  # one of the two
        # sent last on the same link (a barrier may run in shared memory, off the links)
        tandem.recv(torch.empty(1), 0, tag=9)
    tandem.barrier()
    tandem.destroy_process_group()
    return logged.messages()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.procs
def test_sends_nobody_received_are_named_when_the_group_is_destroyed(backend: str) -> None:
    from tandem.testing import spawn

    on_sender, on_receiver = spawn(2, _unreceived, backend=backend, timeout=60)
    assert on_sender == [], on_sender
    assert len(on_receiver) == 1, on_receiver
    text = on_receiver[0]
    assert "rank 1 closes group 'default' with 2 message(s)" in text, text
    assert "from rank 0 with tag 5: 1 message(s) of 16 bytes" in text, text
    assert "from rank 0 with tag 7: 1 message(s) of 16 bytes" in text, text


def test_a_group_whose_sends_were_all_received_closes_quietly() -> None:
    def body(g):
        logged = capture_logs("no receive took")
        try:
            if g.rank() == 0:
                tandem.send(torch.ones(3), 1, group=g, tag=2)
            else:
                tandem.recv(torch.empty(3), 0, group=g, tag=2)
            tandem.barrier(group=g)
            g.close()
        finally:
            logging.getLogger("tandem").removeHandler(logged)
        return logged.messages()

    assert run_threads(2, body) == [[], []]
