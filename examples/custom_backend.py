"""A custom backend: a transport that counts the bytes each rank sends.

Run it (2 local processes, no launcher needed)::

    python examples/custom_backend.py

A backend is a factory ``make(options: tandem.BackendOptions) -> Transport``. Register
it with ``tandem.Backend.register_backend(name, make)`` in every process, before
``init_process_group(name, ...)``; every collective then runs over the transport it
returns, unchanged. Here the transport wraps the built-in TCP one and counts what goes
through ``isend`` (the one method a transport must implement; receives are matched by
the wrapped transport's mailbox).

The check at the end: with 2 ranks, an all_reduce of N float32 values makes each rank
send exactly 4 N payload bytes whichever algorithm runs (doubling: one swap; ring:
half the buffer in each of two phases; naive: in once, out once).
"""

from __future__ import annotations

import tempfile
import threading

import torch

import tandem
from tandem.testing import spawn
from tandem.transport import Header, Slot, TcpTransport, Transport


class CountingTransport(Transport):
    """Forwards everything to ``inner``; counts payload bytes and messages sent."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.mailbox = inner.mailbox  # the inner transport's readers deliver into it
        self.bytes_sent = 0
        self.messages_sent = 0
        self._lock = threading.Lock()  # isend runs on callers' and engine threads

    def isend(self, peer: int, header: Header, payload: memoryview) -> Slot:
        with self._lock:
            self.bytes_sent += payload.nbytes
            self.messages_sent += 1
        return self.inner.isend(peer, header, payload)

    def close(self) -> None:
        self.inner.close()

    def host_of(self, rank: int) -> str:
        return self.inner.host_of(rank)


made: list[CountingTransport] = []  # the transport this process created, to read counters


def make_counting(options: tandem.BackendOptions) -> Transport:
    inner = TcpTransport(options.rank, options.world_size, options.store, options.host,
                         options.secret, options.settings.connect_timeout,
                         options.settings.max_frame, options.hostname,
                         advertise=options.advertise)
    transport = CountingTransport(inner)
    made.append(transport)
    return transport


def worker(rank: int, world_size: int, store_file: str) -> dict[str, object]:
    tandem.Backend.register_backend("counting", make_counting)
    tandem.init_process_group("counting", init_method=f"file://{store_file}", rank=rank,
                              world_size=world_size)
    try:
        transport = made[-1]
        numel = 100_000
        t = torch.full((numel,), float(rank + 1))
        before = transport.bytes_sent
        tandem.all_reduce(t)
        sent = transport.bytes_sent - before
        assert torch.equal(t, torch.full((numel,), float(world_size * (world_size + 1) // 2)))
        return {"backend": tandem.get_backend(), "all_reduce_bytes": sent,
                "expected_bytes": 4 * numel, "messages": transport.messages_sent}
    finally:
        tandem.destroy_process_group()


def main() -> list[dict[str, object]]:
    with tempfile.TemporaryDirectory() as tmp:
        # init=False: each worker registers the backend, then initialises with it
        results = spawn(2, worker, (f"{tmp}/store",), init=False, timeout=120)
    for rank, r in enumerate(results):
        print(f"rank {rank}: backend {r['backend']!r} sent {r['all_reduce_bytes']} bytes for "
              f"an all_reduce of 100000 float32 (expected {r['expected_bytes']}), "
              f"{r['messages']} messages in all")
        assert r["backend"] == "counting"
        assert r["all_reduce_bytes"] == r["expected_bytes"]
    print("custom backend OK")
    return results


if __name__ == "__main__":
    main()
