"""The transport conformance checks: what every Transport must do, written once.

Each check is run by *both* ranks of a pair (``me``, ``peer``) with the same
arguments and returns a small JSON-able record that the tests assert on; checks
use their own group ids, so they never see each other's messages. ``run_all``
runs every check over the given pairs (ranks outside a pair idle meanwhile) and
is what a rank body calls, in a thread (loopback) or a process (tcp, shm, mixed)::

    records = run_all(transport, pairs=[(0, 1)])   # on every rank
    records["sizes/0-1"]["ok"]                      # one record per check and pair
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable

from tandem.errors import CollectiveMismatchError, StateError, TandemError
from tandem.transport.base import Header, Kind, Slot, Transport

SIZES = [0, 1, 4096, (10 << 20) + 3]  # around and across a ring of 1 MiB
WAIT_S = 30.0


def pattern(n: int, salt: int) -> bytes:
    return random.Random(salt).randbytes(n)


def send(t: Transport, peer: int, group: int, seq: int, step: int, data: bytes,
         kind: int = Kind.P2P, sig: bytes = b"") -> Slot:
    return t.isend(peer, Header(kind, group, seq, step, len(data), sig, b"conformance"),
                   memoryview(data))


def recv(t: Transport, peer: int, group: int, seq: int, step: int, n: int,
         kind: int = Kind.P2P, sig: bytes = b"") -> tuple[Slot, bytearray]:
    buf = bytearray(n)
    return t.irecv(peer, kind, group, seq, step, memoryview(buf), sig), buf


def wait(slot: Slot) -> None:
    if not slot.event.wait(WAIT_S):
        raise AssertionError(f"no completion within {WAIT_S}s for {slot.key}")
    if slot.error is not None:
        raise slot.error


def _error(slot: Slot) -> str:
    slot.event.wait(WAIT_S)
    return type(slot.error).__name__ if slot.error is not None else "none"


# -- checks: each returns a record, the same on both ranks of the pair ------------------
def check_sizes(t: Transport, me: int, peer: int, group: int) -> dict[str, Any]:
    """Both directions at once, every size, posted before arrival."""
    got = {}
    for i, n in enumerate(SIZES):
        r, buf = recv(t, peer, group, i, 0, n)
        s = send(t, peer, group, i, 0, pattern(n, 1000 * me + i))
        wait(s)
        wait(r)
        got[n] = bytes(buf) == pattern(n, 1000 * peer + i) and r.nbytes == n
    return {"ok": got}


def check_order(t: Transport, me: int, peer: int, group: int) -> dict[str, Any]:
    """Messages between two ranks arrive in the order they were sent."""
    count = 200
    if me < peer:
        for i in range(count):
            send(t, peer, group, i, 0, i.to_bytes(4, "little") * 16)
        return {"order": list(range(count))}
    order = []
    for _ in range(count):
        box = bytearray(64)

        def any_message(_p: int, h: Header) -> bool:
            return bool(h.kind == Kind.P2P and h.group == group)

        # a receive that any message of the group satisfies takes the earliest arrival
        slot = t.mailbox.post_any([peer], Kind.P2P, group, memoryview(box), any_message)
        wait(slot)
        assert slot.header is not None
        order.append(slot.header.seq if box[:4] == slot.header.seq.to_bytes(4, "little") else -1)
    return {"order": order}


def check_parked(t: Transport, me: int, peer: int, group: int) -> dict[str, Any]:
    """A message that arrives before its receive is posted waits for it."""
    sizes = [5, (3 << 20) + 1]
    for i, n in enumerate(sizes):
        wait(send(t, peer, group, i, 0, pattern(n, 7 * me + i)))
    wait(send(t, peer, group, len(sizes), 0, b"last"))
    # messages from one peer arrive in order: once this one is in, the others are parked
    last, _ = recv(t, peer, group, len(sizes), 0, 4)
    wait(last)
    ok = []
    for i, n in enumerate(sizes):
        r, buf = recv(t, peer, group, i, 0, n)
        wait(r)
        ok.append(bytes(buf) == pattern(n, 7 * peer + i))
    return {"ok": ok}


def check_concurrent(t: Transport, me: int, peer: int, group: int) -> dict[str, Any]:
    """Four threads send 40 messages each while receives are posted in shuffled order."""
    rng = random.Random(42)
    sizes = [rng.choice([0, 1, 100, 4096, 70_000, 300_000]) for _ in range(160)]
    errors: list[str] = []

    def sender(k: int) -> None:
        try:
            for i in range(k, len(sizes), 4):
                wait(send(t, peer, group, i, 1, pattern(sizes[i], me * 10_000 + i)))
        except BaseException as exc:  # noqa: BLE001 - reported in the record
            errors.append(repr(exc))

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    order = list(range(len(sizes)))
    random.Random(me).shuffle(order)
    posted = {i: recv(t, peer, group, i, 1, sizes[i]) for i in order}
    bad = []
    for i, (slot, buf) in posted.items():
        wait(slot)
        if bytes(buf) != pattern(sizes[i], peer * 10_000 + i):
            bad.append(i)
    for th in threads:
        th.join()
    return {"bad": bad, "errors": errors}


def check_self(t: Transport, me: int, peer: int, group: int) -> dict[str, Any]:
    """A rank can message itself (used by collectives on one rank's own data)."""
    data = pattern(5000, me)
    r, buf = recv(t, me, group, 0, 0, len(data))
    wait(send(t, me, group, 0, 0, data))
    wait(r)
    return {"ok": bytes(buf) == data}


def check_mismatch(t: Transport, me: int, peer: int, group: int) -> dict[str, Any]:
    """Wrong signature or size fails the receive; the next message still arrives intact."""
    sig_r, _ = recv(t, peer, group, 0, 0, 64, kind=Kind.COLL, sig=b"all_reduce float[16]")
    size_r, _ = recv(t, peer, group, 1, 0, 64, kind=Kind.COLL, sig=b"same")
    good_r, buf = recv(t, peer, group, 2, 0, 100, kind=Kind.COLL, sig=b"same")
    send(t, peer, group, 0, 0, pattern(64, 1), kind=Kind.COLL, sig=b"broadcast float[16]")
    send(t, peer, group, 1, 0, pattern(65, 2), kind=Kind.COLL, sig=b"same")
    wait(send(t, peer, group, 2, 0, pattern(100, 3), kind=Kind.COLL, sig=b"same"))
    wait(good_r)
    return {"signature": _error(sig_r), "size": _error(size_r),
            "next": bytes(buf) == pattern(100, 3),
            "message": str(sig_r.error) if sig_r.error else ""}


def check_abort(t: Transport, me: int, peer: int, group: int) -> dict[str, Any]:
    """An abort by one rank fails the peer's pending receives on that group alike."""
    r, _ = recv(t, peer, group, 0, 0, 8, kind=Kind.COLL)
    if me < peer:
        t.abort(group, [me, peer], CollectiveMismatchError("rank told everyone to stop"))
    slot_error = _error(r)
    return {"error": slot_error, "message": str(r.error)}


CHECKS: dict[str, Callable[[Transport, int, int, int], dict[str, Any]]] = {
    "sizes": check_sizes, "order": check_order, "parked": check_parked,
    "concurrent": check_concurrent, "self": check_self, "mismatch": check_mismatch,
    "abort": check_abort,
}


def run_all(t: Transport, pairs: list[tuple[int, int]],
            barrier: Callable[[], None]) -> dict[str, Any]:
    """Run every check over every pair; ``barrier()`` separates the pairs."""
    records: dict[str, Any] = {}
    for p, (a, b) in enumerate(pairs):
        for c, (name, check) in enumerate(CHECKS.items()):
            if t.rank in (a, b):
                peer = b if t.rank == a else a
                try:
                    records[f"{name}/{a}-{b}"] = check(t, t.rank, peer, 1000 * p + 10 * c + 1)
                except (TandemError, AssertionError) as exc:
                    records[f"{name}/{a}-{b}"] = {"exception": repr(exc)}
        barrier()
    return records


def check_peer_closed(t: Transport, me: int, peer: int, closer: bool) -> dict[str, Any]:
    """Last: ``closer`` closes; the other's pending receive fails naming the lost rank."""
    if closer:
        posted, _ = recv(t, peer, 99_998, 0, 0, 1)
        wait(posted)  # the other's receive is pending now
        t.close()
        return {}
    r, _ = recv(t, peer, 99_999, 0, 0, 8)
    wait(send(t, peer, 99_998, 0, 0, b"p"))
    start = time.monotonic()
    r.event.wait(WAIT_S)
    error = r.error
    return {"error": type(error).__name__, "rank": getattr(error, "rank", None),
            "message": str(error), "elapsed": time.monotonic() - start,
            "is_state_error": isinstance(error, StateError)}
