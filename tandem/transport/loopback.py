"""In-process loopback transport: ranks are threads of one process.

Fast and deterministic, for testing collective algorithms without sockets. A
message is copied once, from the sender's buffer into the receiver's posted
memory (or parked until the receive is posted), exactly like the TCP path.

``LoopbackHub(4, hosts=["a", "a", "b", "b"])`` makes the ranks report those host
identities (``host_of``), so topology-aware algorithms can be tested on threads.
"""

from __future__ import annotations

from typing import Sequence

from tandem.errors import ArgumentError, PeerLostError
from tandem.transport.base import Transport, check_header
from tandem.transport.mailbox import Mailbox
from tandem.transport.message import Header, Slot, reader_of

__all__ = ["LoopbackHub", "LoopbackTransport"]


class LoopbackTransport(Transport):
    def __init__(self, hub: "LoopbackHub", rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self.world_size = hub.world_size
        self.mailbox = Mailbox(rank)
        self.mailbox.reply = lambda peers, group, error: self.abort(group, peers, error)
        self.closed = False

    def isend(self, peer: int, header: Header, payload: memoryview) -> Slot:
        slot = Slot(peer, (peer, header.kind, header.group, header.seq, header.step), None, b"")
        target = self.hub.transports[peer]
        if target.closed:
            raise PeerLostError(f"rank {peer} closed its loopback transport", peer)
        check_header(header, header.nbytes, peer)  # in one process: no frame to cap
        data = payload.cast("B") if payload.format != "B" or payload.ndim != 1 else payload
        target.mailbox.arrive(self.rank, header, reader_of(data))
        slot.finish(header)
        return slot

    def host_of(self, rank: int) -> str:
        return self.hub.hosts[rank] if self.hub.hosts else ""

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.mailbox.close(self.closed_error())
        for t in self.hub.transports:
            if t is not self and not t.closed:
                t.mailbox.peer_lost(self.rank, PeerLostError(
                    f"rank {self.rank} closed its loopback transport", self.rank))


class LoopbackHub:
    """Creates ``world_size`` connected loopback transports, on hosts ``hosts`` if given."""

    def __init__(self, world_size: int, hosts: Sequence[str] | None = None) -> None:
        if hosts is not None and len(hosts) != world_size:
            raise ArgumentError(f"{len(hosts)} host names for {world_size} ranks")
        self.world_size = world_size
        self.hosts = list(hosts or [])
        self.transports = [LoopbackTransport(self, r) for r in range(world_size)]
