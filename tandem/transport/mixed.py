"""Topology: which ranks share a host, and a transport that routes each peer to shm or tcp.

Host identity is the host name (``TANDEM_HOST_ID`` overrides it, e.g. to simulate
hosts in tests) plus the kernel's boot id and the network namespace, so two machines
that happen to share a host name, or two containers of one machine, are never
mistaken for one host. Every rank publishes it in the store::

    hosts = exchange_hosts(store, rank, world_size, hostname)   # one entry per rank
    require_one_host(hosts)                                      # backend="shm"
    t = MixedTransport(tcp, shm)       # same-host peers via shm, the rest via tcp

The mixed transport's two halves share one :class:`~tandem.transport.base.Mailbox`
(the shm transport is built with ``mailbox=tcp.mailbox``), so receives, parked
early arrivals, lost peers and aborts are matched in one place whichever way a
message came.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Sequence

from tandem.errors import ArgumentError, PeerLostError, TandemError
from tandem.transport._arena import Arena
from tandem.store.base import Store
from tandem.transport.base import Poller, Transport, _abort_message, one_drop_warning
from tandem.transport.failures import split_relay, with_relay
from tandem.transport.message import Header, Kind, Reader, Slot
from tandem.transport.shm import ShmTransport
from tandem.transport.tcp import LOST_NOTICE, TcpTransport, act_on_abort

__all__ = ["MixedTransport", "exchange_hosts", "require_one_host", "host_key", "same_host"]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _boot_id() -> str:
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


# read at import: the machine's, for as long as the process lives (a forked worker's too)
_BOOT = _boot_id()


def host_key(hostname: str) -> str:
    """``hostname`` plus this machine's boot id and this process's network namespace:
    equal only for processes that can share memory and reach each other's abstract
    UNIX sockets (namespaces, e.g. containers, are told apart even under one name; the
    namespace is read each time: a process may enter another after import)."""
    boot = _BOOT
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    return f"{hostname}|{boot}|{netns}"


def exchange_hosts(store: Store, rank: int, world_size: int, hostname: str,
                   published: Callable[[], None] | None = None) -> list[str]:
    """Publish this rank's host key and return every rank's (index = rank); ``published``
    is called in between, before the wait for the others' keys.

    Each entry carries its rank's world size too: ranks started with different ones are
    told at once, naming both, instead of waiting for a rank that will never come. The
    entries are read in two store round trips (a get per rank made start-up O(world^2)):
    first this rank's and the lower ones', which exist in any job, then the higher ones.
    A rank that sees a larger world size than its own fills the keys of the ranks that
    will never start with a note naming itself, so the larger rank is told at once too.
    """
    store.set(f"topology/host/{rank}", f"{host_key(hostname)}#{world_size}")
    if published is not None:
        published()
    entries = store.multi_get([f"topology/host/{r}" for r in range(rank + 1)])
    _check_worlds(store, rank, world_size, 0, entries)
    later = store.multi_get([f"topology/host/{r}" for r in range(rank + 1, world_size)])
    _check_worlds(store, rank, world_size, rank + 1, later)
    hosts = []
    for entry in entries + later:
        key, _, world = entry.decode().rpartition("#")
        hosts.append(key if world.isdigit() else f"{key}#{world}" if key else world)
    return hosts


_ABSENT = "!"  # the entry of a rank that will never start, written by the rank that knows


def _check_worlds(store: Store, rank: int, world_size: int, first: int,
                  entries: list[bytes]) -> None:
    for r, entry in enumerate(entries, first):
        key, _, world = entry.decode().rpartition("#")
        if key.startswith(_ABSENT):
            r, world = int(key[len(_ABSENT):]), world  # the rank that wrote the note
        if not world.isdigit() or int(world) == world_size:
            continue
        for missing in range(world_size, int(world)):  # ranks the larger job waits for
            store.compare_set(f"topology/host/{missing}", "", f"{_ABSENT}{rank}#{world_size}")
        raise ArgumentError(f"rank {rank} was started with world_size={world_size} but "
                            f"rank {r} with world_size={world}: every rank must be given "
                            f"the same world size")


def same_host(hosts: list[str], rank: int) -> list[int]:
    """The ranks on ``rank``'s host, itself included, in order."""
    return [r for r, h in enumerate(hosts) if h == hosts[rank]]


def _name(key: str) -> str:
    return key.partition("|")[0] or key


def require_one_host(hosts: list[str]) -> None:
    """Raise ``ArgumentError`` naming the hosts when the ranks do not share one host."""
    groups: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        groups.setdefault(h, []).append(r)
    if len(groups) <= 1:
        return
    names = [_name(h) for h in groups]
    parts = "; ".join(f"host '{_name(h)}' has rank(s) {rs}" for h, rs in groups.items())
    why = (" (same name, different machines or network namespaces: their boot ids or "
           "namespaces differ)"
           if len(set(names)) < len(names) else "")
    raise ArgumentError(f"backend 'shm' needs every rank on one host, but the ranks span "
                        f"{len(groups)} hosts{why}: {parts}; use backend 'auto' (shared memory "
                        f"within a host, tcp across) or 'tcp'")


class MixedTransport(Transport):
    """Routes same-host peers through ``shm`` and every other peer through ``tcp``.

    Each peer has exactly one link: ``tcp`` connects to the other hosts' ranks only
    (``TcpTransport(peers=...)``), so a peer's messages, and its goodbye after them,
    arrive in the order they were sent.

    tcp connects on first use, so a rank holds no connection to most ranks of other
    hosts. Failure news crosses hosts through one rank per host instead: a non-leader
    hands an abort for other hosts to its host leader; a leader sends it to one rank of
    each other host (one already connected, else the lowest), which passes it on to
    the rest of its host before acting on it; a rank that dies is
    announced by the lowest live rank of its host the same way (``LOST_NOTICE``), so
    a rank of another host waiting on it learns at once without a connection to it.
    """

    def __init__(self, tcp: Transport, shm: ShmTransport) -> None:
        if shm.mailbox is not tcp.mailbox:
            raise ArgumentError("MixedTransport needs shm built with mailbox=tcp.mailbox")
        self.rank = tcp.rank
        self.world_size = tcp.world_size
        self.mailbox = tcp.mailbox
        self.tcp = tcp
        self.shm = shm
        self._keys = tcp.host_keys if isinstance(tcp, TcpTransport) else []
        self._leaders: dict[str, int] = {}  # each host's lowest rank
        for r, key in enumerate(self._keys):
            self._leaders.setdefault(key, r)
        # a rank rejecting a stray message tells its sender, by whichever way reaches it
        # (set once routing is known: a refusal may come from another thread at once)
        self.mailbox.reply = lambda peers, group, error: self.abort(group, peers, error)
        if self._keys:
            self.mailbox.handle(Kind.ABORT, self._on_abort)
            first_hand = self.mailbox.peer_lost

            def peer_lost(peer: int, error: PeerLostError) -> None:
                first_hand(peer, error)
                self._announce_lost(peer)

            self.mailbox.peer_lost = peer_lost  # type: ignore[method-assign]
            # news that came while this rank was still setting up (its host mates may
            # finish theirs first): passed on now, not lost
            if isinstance(tcp, TcpTransport):
                tcp.pass_news_on(self._pass_on)
            for peer in self.mailbox.failures.all_lost():
                self._announce_lost(peer)
        if isinstance(tcp, TcpTransport):  # refusals made before it: their senders hear now
            tcp.pass_refusals_on(self.mailbox.reply)

    # -- failure news across hosts -------------------------------------------------------
    def _by_host(self, ranks: Sequence[int]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for r in sorted(ranks):
            out.setdefault(self._keys[r], []).append(r)
        return out

    def _tell_abort(self, group: int, error: TandemError, targets: list[int]) -> None:
        if not self._keys:
            super()._tell_abort(group, error, targets)
            return
        local = [p for p in targets if self.shm.reaches(p)]
        remote = [p for p in targets if not self.shm.reaches(p)]
        header, data = _abort_message(group, error, self.rank)
        leader = self._leaders[self._keys[self.rank]]
        if remote and leader != self.rank and self.lost(leader) is None:
            # the host leader, connected to the other leaders, carries it across: this
            # rank dials nobody, and its host mates hear first (it may leave right after)
            try:
                relayed = with_relay(data, remote)
                self.shm.isend(leader, header._replace(nbytes=len(relayed)),
                               memoryview(relayed))
                local = [p for p in local if p != leader]
                remote = []
            except TandemError:
                pass
        super()._tell_abort(group, error, local)
        self._tell_hosts(header, data, remote)

    def _tell_hosts(self, header: Header, data: bytes, remote: Sequence[int]) -> None:
        """Send the news ``data`` (an ABORT payload) to one rank of each host of ``remote``,
        which relays it to the others: a rank already connected to this one first, else
        the lowest."""
        tcp = self.tcp
        assert isinstance(tcp, TcpTransport)
        for ranks in self._by_host(remote).values():
            live = [r for r in ranks if self.lost(r) is None]
            for relay in sorted(live, key=lambda r: (not tcp.connected(r), r)):
                out = with_relay(data, [r for r in ranks if r != relay])
                try:
                    tcp.isend(relay, header._replace(nbytes=len(out)), memoryview(out))
                    break
                except TandemError:
                    continue  # that one is gone too: the next one relays

    def _on_abort(self, peer: int, header: Header, read: Reader) -> None:
        """An ABORT (or a lost-rank notice): passed on to the ranks it names first, so
        they know before this rank, having acted on it, may leave."""
        try:
            buf = bytearray(header.nbytes)
            read(memoryview(buf))
            act_on_abort(self.mailbox, self.rank, header, self._pass_on(header, bytes(buf)))
        except Exception:  # noqa: BLE001 - a handler must not raise (Mailbox.handle)
            pass

    def _pass_on(self, header: Header, data: bytes) -> bytes:
        """Send the news ``data`` (an ABORT payload) on to the ranks it names; return it
        with no one left to pass it on to."""
        relay, passed = split_relay(data)
        if relay:
            out = header._replace(nbytes=len(passed))
            for r in relay:
                if r != self.rank and self.shm.reaches(r) and self.lost(r) is None:
                    try:
                        self.shm.isend(r, out, memoryview(passed))
                    except TandemError:
                        pass
            # ranks of other hosts: through one rank of each (a leader passing on
            # news from its own host)
            self._tell_hosts(header, passed, [r for r in relay if r != self.rank
                                              and not self.shm.reaches(r)])
        return passed

    def _announce_lost(self, peer: int) -> None:
        """``peer`` of this host died: the lowest live rank of the host tells the others."""
        error = self.mailbox.failures.lost(peer)
        if error is None or not self.shm.reaches(peer) or peer == self.rank:
            return  # it left on purpose, or it is another host's to announce
        if not isinstance(self.tcp, TcpTransport) or self.tcp.closing:
            return  # this rank is going: its own connections closing prove nothing
        mates = [r for r in range(self.world_size) if self._keys[r] == self._keys[self.rank]]
        if min(r for r in mates if r != peer and self.lost(r) is None) != self.rank:
            return
        remote = [r for r in range(self.world_size) if not self.shm.reaches(r)
                  and r != self.rank]
        header, data = _abort_message(LOST_NOTICE, error, self.rank)
        threading.Thread(target=self._tell_hosts, args=(header, data, remote),
                         daemon=True, name=f"tandem-lost-{self.rank}").start()

    def route(self, peer: int) -> Transport:
        """The transport that carries messages to ``peer``."""
        return self.shm if self.shm.reaches(peer) else self.tcp

    def connected(self, peer: int) -> bool:
        return self.route(peer).connected(peer)

    def isend(self, peer: int, header: Header, payload: memoryview) -> Slot:
        return self.route(peer).isend(peer, header, payload)

    def isendv(self, peer: int, header: Header, pieces: Sequence[memoryview]) -> Slot:
        return self.route(peer).isendv(peer, header, pieces)

    def send_now(self, peer: int, header: Header, pieces: Sequence[memoryview]) -> bool:
        return self.route(peer).send_now(peer, header, pieces)

    def host_of(self, rank: int) -> str:
        return self.route(rank).host_of(rank)

    def poller(self, peer: int) -> Poller | None:
        return self.route(peer).poller(peer)

    def shares_memory_with(self, ranks: Sequence[int]) -> bool:
        return self.shm.shares_memory_with(ranks)

    def arena(self, key: int, members: Sequence[int], chunk: int | None = None,
              timeout: float | None = None,
              check: Callable[[], None] | None = None) -> Arena:
        return self.shm.arena(key, members, chunk, timeout, check)

    def close(self) -> None:
        self._finish_telling()  # aborts this transport started reach their queues first
        with one_drop_warning(self.rank):  # both transports' dropped sends in one warning
            try:
                self.shm.close()
            finally:
                self.tcp.close()
