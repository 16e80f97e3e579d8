"""Failure news that reaches a host leader while it is still setting up is passed on, not
dropped: its host mates finish their set-up first (a leader hands them their sockets,
then has its own part to finish) and may begin a call, fail it, and hand the leader an
abort for the other hosts, or die, before the leader's mixed transport, which carries
news across hosts, exists. Before, the leader acted on such an abort itself but never
passed it on, and announced no such death: the other hosts waited for the deadline.

Two simulated hosts of two ranks each (threads of this process, told apart by host
name), built by the ``auto`` backend; rank 0 (host a's leader) is held between its
shared memory and its mixed transport until the news has reached it, as a loaded
machine may hold it.

A message such a leader refuses in that window (a same-host sender overran its cap on
early messages) is refused to its sender over shared memory once the mixed transport
exists: before, the refusal went to tcp, which has no link to a same-host rank, and was
dropped, so the sender waited for its deadline."""

from __future__ import annotations

import threading
from typing import Any, Iterator

import pytest

from tandem.collectives import backend
from tandem.collectives.backend import BackendOptions
from tandem.errors import PeerLostError, StateError
from tandem.store import HashStore
from tandem.testing import wait_until
from tandem.transport import Header, Kind, Slot
from tandem.transport.mixed import MixedTransport
from tandem.transport.shm import unsupported_reason
from tandem.transport.tcp import TcpTransport

from _cut import vanish
from _tcp_job import two_hosts_rank

SECRET = b"news-at-setup-secret"
DEADLINE = 60.0  # the store's and each set-up's, on a loaded machine
NOTICED_WITHIN = 5.0  # seconds from rank 0's release to the news at host b

pytestmark = pytest.mark.skipif(bool(unsupported_reason()), reason="no shared memory here")


class HeldJob:
    """Ranks 0, 1 on host a and 2, 3 on host b, each built on a thread of its own; rank
    0 waits after its shared memory is made until :meth:`release`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.store = HashStore(DEADLINE)
        self.made: list[Any] = [None] * 4
        self.built = [threading.Event() for _ in range(4)]
        self.held = threading.Event()  # rank 0 has its shared memory, not its mixed transport
        self._go = threading.Event()
        self.shm0: Any = None
        shm_over = backend._shm_over

        def shm(options: BackendOptions, peers: list[int], tcp: Any) -> Any:
            made = shm_over(options, peers, tcp)
            if options.rank == 0:
                self.shm0 = made
                self.held.set()
                self._go.wait(DEADLINE)
            return made

        monkeypatch.setattr(backend, "_shm_over", shm)
        self.threads = [threading.Thread(target=self._build, args=(r,), daemon=True)
                        for r in range(4)]
        for t in self.threads:
            t.start()

    def _build(self, rank: int) -> None:
        try:
            self.made[rank] = two_hosts_rank(self.store, rank, SECRET)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.made[rank] = exc
        finally:
            self.built[rank].set()

    def ready(self, rank: int) -> MixedTransport:
        assert self.built[rank].wait(DEADLINE), f"rank {rank} was not built"
        made = self.made[rank]
        assert isinstance(made, MixedTransport), made
        return made

    def release(self) -> MixedTransport:
        self._go.set()
        return self.ready(0)

    def close(self) -> None:
        self._go.set()
        for t in self.threads:
            t.join(DEADLINE)
        for m in self.made:
            if isinstance(m, MixedTransport):
                m.close()


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldJob]:
    held = HeldJob(monkeypatch)
    yield held
    held.close()


def _failed(slot: Slot) -> BaseException | None:
    assert slot.event.wait(NOTICED_WITHIN), "the news did not reach its rank"
    return slot.error


def _tcp(t: MixedTransport) -> TcpTransport:
    assert isinstance(t.tcp, TcpTransport)
    return t.tcp


def test_an_abort_handed_to_a_leader_in_set_up_reaches_the_other_hosts(job: HeldJob) -> None:
    one, three = job.ready(1), job.ready(3)
    job.ready(2)
    assert job.held.wait(DEADLINE)
    waiting = three.irecv(1, Kind.COLL, 5, 0, 0, memoryview(bytearray(4)))
    one.abort(5, [0, 2, 3], StateError("boom"))  # through rank 0, which relays it
    wait_until(lambda: job.shm0.mailbox.failures.aborted(5) is not None,
               "rank 0 to hear of the abort", DEADLINE)
    zero = job.release()
    error = _failed(waiting)
    assert isinstance(error, StateError) and "[reported by rank 1] boom" in str(error), error
    assert zero.aborted(5) is not None
    assert not _tcp(one).connected(3) and not _tcp(three).connected(1), \
        "the news must go through the hosts' leaders, not by a new connection"


def test_a_rank_that_died_while_its_leader_set_up_is_named_to_the_other_hosts(
        job: HeldJob) -> None:
    one, three = job.ready(1), job.ready(3)
    job.ready(2)
    assert job.held.wait(DEADLINE)
    waiting = three.irecv(1, Kind.P2P, 0, 0, 0, memoryview(bytearray(4)))
    vanish(_tcp(one))  # what the kernel does for a SIGKILLed process
    vanish(one.shm)
    wait_until(lambda: job.shm0.mailbox.failures.lost(1) is not None,
               "rank 0 to notice rank 1's death", DEADLINE)
    job.release()
    error = _failed(waiting)
    assert isinstance(error, PeerLostError) and error.rank == 1, error
    assert "rank 1 died (reported by rank 0)" in str(error), error


def test_a_refusal_made_by_a_leader_in_set_up_reaches_its_same_host_sender(
        job: HeldJob) -> None:
    one = job.ready(1)
    job.ready(2)
    job.ready(3)
    assert job.held.wait(DEADLINE)
    job.shm0.mailbox.park_limit = 8  # the second early message below overruns it
    waiting = one.irecv(0, Kind.P2P, 7, 0, 0, memoryview(bytearray(4)))
    one.isend(0, Header(Kind.P2P, 7, 0, 0, 8), memoryview(bytes(8)))
    one.isend(0, Header(Kind.P2P, 7, 1, 0, 64), memoryview(bytes(64)))
    wait_until(lambda: job.shm0.mailbox.failures.aborted(7) is not None,
               "rank 0 to refuse the second message", DEADLINE)
    job.release()
    error = _failed(waiting)  # the sender hears at once, not at its deadline
    assert isinstance(error, StateError) and "cap on early messages is 8 bytes" in str(error), \
        error
