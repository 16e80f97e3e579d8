"""Start-up reads the store in O(1) round trips per rank, not O(world).

Building a rank's transport used to read each peer's store entry with a request of its
own (host keys, shared-memory socket names, TCP addresses): O(world) round trips per
rank and O(world^2) for the job, the largest share of start-up at 16-32 ranks on one
host. The ranks here are threads of this process, each with its own TCPStore client,
whose requests are counted.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Iterator

import pytest

from tandem.collectives.backend import Backend, BackendOptions
from tandem.config import load_settings
from tandem.errors import ArgumentError
from tandem.store import HashStore, PrefixStore, TCPStore
from tandem.store.base import Store
from tandem.transport.base import Transport
from tandem.transport.mixed import exchange_hosts

SECRET = b"startup-test-secret"
DEADLINE = 60.0  # generous: the machine may be loaded; a passing run takes about a second


@pytest.fixture
def master() -> Iterator[TCPStore]:
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=DEADLINE, secret=SECRET)
    yield store
    store.close()


def _counted(master: TCPStore) -> tuple[TCPStore, collections.Counter[str]]:
    """A client of ``master``'s server whose requests are counted by op."""
    client = TCPStore("127.0.0.1", master.port, timeout=DEADLINE, secret=SECRET)
    ops: collections.Counter[str] = collections.Counter()
    call = client._client.call

    def counting(op: Any, fields: Any, wait: float = 0.0) -> Any:
        ops[op.name] += 1
        return call(op, fields, wait)

    client._client.call = counting  # type: ignore[method-assign]
    return client, ops


def _on_ranks(world: int, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` on ``world`` threads at once; each one's result, or its exception."""
    results: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
    assert not any(t.is_alive() for t in threads), "a rank did not finish within the deadline"
    return results


def test_the_host_exchange_takes_three_requests_per_rank_at_16_ranks(master: TCPStore) -> None:
    world = 16
    clients = [_counted(master) for _ in range(world)]
    hosts = _on_ranks(world, lambda r: exchange_hosts(clients[r][0], r, world, "host-a"))
    try:
        assert all(h == hosts[0] for h in hosts) and len(hosts[0]) == world, hosts
        for rank, (_, ops) in enumerate(clients):
            # one set, the lower ranks' entries, the higher ranks' entries
            assert sum(ops.values()) <= 3, f"rank {rank}: {dict(ops)}"
    finally:
        for client, _ in clients:
            client.close()


# (world size each rank was given, the ranks that must be told); in (2, 2, 4) ranks 0
# and 1 form a complete 2-rank job of their own: only rank 2 can know
@pytest.mark.parametrize("worlds,told", [((2, 3), {0, 1}), ((3, 2), {0, 1}),
                                         ((2, 2, 4), {2}), ((4, 2, 4), {0, 1, 2})])
def test_ranks_given_different_world_sizes_are_told_at_once(worlds: tuple[int, ...],
                                                            told: set[int]) -> None:
    # a rank of the larger world waits for ranks that never start, unless told
    store = HashStore(DEADLINE)
    start = time.monotonic()
    results = _on_ranks(len(worlds), lambda r: exchange_hosts(store, r, worlds[r], "h"))
    assert time.monotonic() - start < DEADLINE / 2, "a rank waited for its store deadline"
    for rank in told:
        assert isinstance(results[rank], ArgumentError), (rank, results[rank])
        assert f"rank {rank} was started with world_size={worlds[rank]} but rank" in \
            str(results[rank]), results[rank]


def _build(store: Store, rank: int, world: int, hostname: str) -> Transport:
    settings = load_settings()
    options = BackendOptions(store=PrefixStore("job", store), rank=rank, world_size=world,
                             host="127.0.0.1", hostname=hostname, secret=SECRET,
                             settings=settings)
    return Backend.factory("auto")(options)


@pytest.mark.parametrize("hosts", [1, 2], ids=["one-host", "two-hosts"])
def test_connecting_16_ranks_takes_a_bounded_number_of_requests_per_rank(
        master: TCPStore, hosts: int) -> None:
    world = 16
    clients = [_counted(master) for _ in range(world)]
    # simulated host names: the host key also carries the boot id and network namespace
    made = _on_ranks(world, lambda r: _build(clients[r][0], r, world, f"h{r % hosts}"))
    try:
        failed = [m for m in made if isinstance(m, BaseException)]
        assert not failed, failed[0]
        for rank, (_, ops) in enumerate(clients):
            # host exchange 3, shm address 1 + 1, tcp address 1 + 2: O(1), not O(world)
            assert sum(ops.values()) <= 8, f"rank {rank}: {dict(ops)}"
    finally:
        for m in made:
            if isinstance(m, Transport):
                m.close()
        for client, _ in clients:
            client.close()
