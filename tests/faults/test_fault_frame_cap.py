"""A message above ``TANDEM_MAX_FRAME`` is refused by its size, before it is allocated."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import tandem as dist
from _fault_helpers import attempt, values
from tandem.collectives.world import world
from tandem.testing import launch, wait_until

pytestmark = [pytest.mark.procs, pytest.mark.timeout(90)]

CAP = 4096
BIG = 4 * CAP  # bytes of the oversized message
OP_TIMEOUT = 10.0
FAST = OP_TIMEOUT / 2  # an error without waiting for the op timeout comes before this


def _raise_own_cap(transport: Any, cap: int) -> None:
    """As if this rank had a larger TANDEM_MAX_FRAME than its peer (each checks its own)."""
    for t in (transport, getattr(transport, "tcp", None), getattr(transport, "shm", None)):
        if t is not None and hasattr(t, "_max_frame"):
            t._max_frame = cap


def _oversized_message(rank: int, world_size: int, tmp: str) -> Any:
    learnt = os.path.join(tmp, "rank0.learnt")
    small = torch.zeros(CAP // 4 // 2)  # half the cap: must pass
    if rank == 0:
        _raise_own_cap(world().transport, 2 * BIG)
        dist.send(small, dst=1)
        big = attempt(dist.send, torch.zeros(BIG // 4), dst=1)
        after = attempt(dist.all_reduce, torch.ones(4))  # does rank 0 learn it was cut off?
        open(learnt, "w").close()
        return {"small": True, "big": big, "after": after}
    got_small = attempt(dist.recv, small, src=0)
    big = attempt(dist.recv, torch.zeros(BIG // 4), src=0)
    # stay alive: rank 0 must not learn of it by our exit
    wait_until(lambda: os.path.exists(learnt), "rank 0 to learn of the refusal", 60)
    return {"small": got_small["ok"], "big": big}


@pytest.fixture(scope="module")
def oversized(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    outcomes = launch(2, _oversized_message, (str(tmp_path_factory.mktemp("cap")),),
                      timeout=40, op_timeout=OP_TIMEOUT, env={"TANDEM_MAX_FRAME": str(CAP)})
    return values(outcomes, [0, 1])


def test_messages_under_the_cap_pass(oversized: Any) -> None:
    assert oversized[0]["small"] and oversized[1]["small"], oversized


def test_receiver_refuses_an_oversized_message_naming_size_and_cap(oversized: Any) -> None:
    r = oversized[1]["big"]
    assert not r["ok"] and r["type"] in ("ProtocolError", "PeerLostError"), r
    assert str(BIG) in r["msg"] and str(CAP) in r["msg"], r
    assert r["elapsed"] < FAST, r


def _sends_past_its_cap(rank: int, world_size: int) -> Any:
    if rank == 0:
        big = attempt(dist.send, torch.zeros(BIG // 4), dst=1)
    else:
        big = {}
    t = torch.ones(4)
    dist.all_reduce(t)  # nothing was cut off: the connection is still up
    return {"big": big, "after": t.tolist()}


def test_a_sender_refuses_a_message_past_its_own_cap_naming_the_setting() -> None:
    outcomes = launch(2, _sends_past_its_cap, timeout=40, op_timeout=OP_TIMEOUT,
                      env={"TANDEM_MAX_FRAME": str(CAP)})
    r = values(outcomes, [0, 1])
    big = r[0]["big"]
    assert not big["ok"] and big["type"] == "ArgumentError", big
    assert f"{BIG} bytes to rank 1 exceeds TANDEM_MAX_FRAME={CAP}" in big["msg"], big
    assert r[0]["after"] == r[1]["after"] == [2.0] * 4, r


def test_sender_learns_at_once_that_its_connection_was_refused(oversized: Any) -> None:
    r = oversized[0]["after"]
    assert not r["ok"] and r["type"] in ("ProtocolError", "PeerLostError"), r
    assert r["elapsed"] < FAST, r


LONG = 100_000  # characters of signature: far beyond a frame's 64 KiB for it


def _long_signature(rank: int, world_size: int, differ: bool) -> Any:
    from tandem.collectives.world import default_group

    g = default_group()
    tail = str(rank) if differ else "same"
    op = g.new_op("custom", "sizes=" + "1," * (LONG // 2) + tail, "site.py:1")
    peer = 1 - rank
    out = torch.zeros(4)
    from tandem.collectives.group import as_bytes

    def body(o: Any) -> None:
        o.wait(o.send(peer, 0, as_bytes(torch.full((4,), float(rank)))),
               o.recv(peer, 0, as_bytes(out)))

    result = attempt(g.run, op, body, False)
    result["got"] = out.tolist()
    result["sig_bytes"] = len(op.sig)
    return result


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_long_signature_is_hashed_and_still_matches(backend: str) -> None:
    outcomes = launch(2, _long_signature, (False,), backend=backend, timeout=40,
                      op_timeout=OP_TIMEOUT)
    for rank, r in values(outcomes, [0, 1]).items():
        assert r["ok"], (rank, r)
        assert r["got"] == [float(1 - rank)] * 4, (rank, r)
        assert r["sig_bytes"] <= 2048, r


def test_long_signatures_that_differ_only_at_the_end_still_mismatch() -> None:
    outcomes = launch(2, _long_signature, (True,), timeout=40, op_timeout=OP_TIMEOUT)
    for rank, r in values(outcomes, [0, 1]).items():
        assert not r["ok"] and r["type"] == "CollectiveMismatchError", (rank, r)
        assert r["elapsed"] < OP_TIMEOUT, (rank, r)
