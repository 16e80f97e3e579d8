"""Rank bodies of the send-then-leave tests (importable by spawned children).

Each returns the problems its rank saw (an empty list: everything arrived and every
send completed), so the test can name the round, the size and what went wrong.
"""

from __future__ import annotations

import hashlib
import os

import torch

import tandem
from tandem.store.file import FileStore
from tandem.store.prefix import PrefixStore
from tandem.transport import Header, Kind
from tandem.transport.message import Slot
from tandem.transport.shm import ShmTransport
from tandem.testing import wait_until

RING = 1 << 16
# one frame in the ring; several rings' worth (streamed through it); by reference (>= 1 MiB)
SIZES = (7, 3000, 5 * RING, 3 << 20)
WAIT_S = 60.0  # generous: the machine may be loaded; a hang fails at this deadline
SECRET = b"send-then-leave"


def payload(round_: int, n: int) -> bytes:
    block = hashlib.sha256(str(round_).encode()).digest()
    return (block * (n // len(block) + 1))[:n]


def _finished(slot: Slot, what: str) -> str | None:
    """None if ``slot`` completed without error, else what went wrong."""
    if not slot.event.wait(WAIT_S):
        return f"{what}: still pending after {WAIT_S:.0f}s"
    return None if slot.error is None else f"{what}: {type(slot.error).__name__}: {slot.error}"


def send_then_leave(rank: int, world: int, store_path: str, rounds: int) -> list[str]:
    """Each round, a fresh pair: rank 1 sends one message (its ring to rank 0 is made by
    that message) and closes at once; rank 0 posts the receive before rank 1 left (even
    rounds of a size) or once it knows rank 1 left (odd ones), then sends to rank 1,
    which has left (its own ring made by that message): the send must complete."""
    base = FileStore(store_path, world)
    problems: list[str] = []
    for i in range(rounds):
        n = SIZES[i % len(SIZES)]
        t = ShmTransport(rank, world, PrefixStore(f"round{i}", base), SECRET,
                         ring_bytes=RING, hostname="h")
        where = f"round {i} ({n} bytes)"
        try:
            if rank == 1:
                sent = t.isend(0, Header(Kind.P2P, 0, i, 0, n), memoryview(payload(i, n)))
                problem = _finished(sent, f"{where}: rank 1's send")
                if problem:
                    problems.append(problem)
                continue  # closes at once
            if (i // len(SIZES)) % 2:
                wait_until(lambda: t.left(1) is not None or t.lost(1) is not None,
                       "rank 1 to leave", WAIT_S)
            buf = bytearray(n)
            got = t.irecv(1, Kind.P2P, 0, i, 0, memoryview(buf))
            problem = _finished(got, f"{where}: rank 0's receive")
            if problem is None and buf != payload(i, n):
                problem = f"{where}: rank 0 received other bytes than rank 1 sent"
            reply = t.isend(1, Header(Kind.P2P, 0, i, 1, n), memoryview(payload(i, n)))
            for p in (problem, _finished(reply, f"{where}: rank 0's send to rank 1, gone")):
                if p:
                    problems.append(p)
            wait_until(lambda: t.left(1) is not None or t.lost(1) is not None, "rank 1's end", WAIT_S)
            if t.lost(1) is not None:
                problems.append(f"{where}: rank 1 said goodbye but was taken for a crash: "
                                f"{t.lost(1)}")
        finally:
            t.close()
    return problems


def gather_after_a_member_left(rank: int, world: int, flag: str) -> list[list[float]] | None:
    """Rank 1 gathers to rank 0 and leaves (destroy_process_group) before rank 0 even
    calls gather: rank 0's part (its announcement to rank 1 among it) must still work."""
    tandem.all_reduce(torch.ones(1))  # the group's shared memory is set up
    out = None
    if rank == 0:
        wait_until(lambda: os.path.exists(flag), "rank 1 to leave", WAIT_S)
        out = [torch.empty(3) for _ in range(world)]
    tandem.gather(torch.full((3,), float(rank)), out, dst=0)
    if rank != 0:
        tandem.destroy_process_group()
        with open(flag, "w"):
            pass
        return None
    assert out is not None
    return [t.tolist() for t in out]
