"""What the ring puts on the wire: how many messages, and receives posted before sends.

Both matter for speed, not for results (those are checked against the oracle in
test_coll_all_reduce_algorithms.py): a message that arrives before its receive is
posted is parked and copied once more, and every posted message keeps Python objects
alive, enough of which set off the cyclic GC (see ``algorithms/ring.py``).
"""

from __future__ import annotations

import threading

import pytest
import torch

import tandem
from tandem.collectives.group import Op, ProcessGroup
from tandem.config import Settings
from tandem.testing import run_threads
from tandem.transport.base import Slot

pytestmark = pytest.mark.timeout(60)


def _events(world_size: int, numel: int, settings: Settings,
            monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """("send"|"recv", step) in the order group rank 0 issued them in one ring all-reduce."""
    log: list[tuple[str, int]] = []
    rank0 = threading.local()
    send, recv = Op.send, Op.recv

    def logged_send(self: Op, to: int, step: int, view: memoryview) -> Slot:
        if getattr(rank0, "on", False):
            log.append(("send", step))
        return send(self, to, step, view)

    def logged_recv(self: Op, frm: int, step: int, view: memoryview) -> Slot:
        if getattr(rank0, "on", False):
            log.append(("recv", step))
        return recv(self, frm, step, view)

    monkeypatch.setattr(Op, "send", logged_send)
    monkeypatch.setattr(Op, "recv", logged_recv)

    def body(group: ProcessGroup) -> None:
        group.algorithm_override["all_reduce"] = "ring"
        rank0.on = group.rank() == 0
        tandem.all_reduce(torch.ones(numel), group=group)

    run_threads(world_size, body, settings=settings)
    return log


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_large_ring_cuts_each_segment_into_at_most_eight_chunks(
        world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    log = _events(world_size, 1 << 20, Settings(chunk_bytes=4096), monkeypatch)
    sends = [e for e in log if e[0] == "send"]
    assert len(sends) == 2 * (world_size - 1) * 8, len(sends)


def test_small_segments_keep_chunks_of_chunk_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 ranks x 24 KiB segments at 4 KiB chunks: six chunks per segment, under the cap
    log = _events(3, 3 * 6 * 1024, Settings(chunk_bytes=4096), monkeypatch)
    assert len([e for e in log if e[0] == "send"]) == 2 * 2 * 6


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_receive_is_posted_before_the_first_send(world_size: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    log = _events(world_size, 1 << 16, Settings(chunk_bytes=4096), monkeypatch)
    first_send = next(i for i, e in enumerate(log) if e[0] == "send")
    recvs = [i for i, e in enumerate(log) if e[0] == "recv"]
    assert len(recvs) == 2 * (world_size - 1) * 8
    assert max(recvs) < first_send, log[:first_send + 3]
