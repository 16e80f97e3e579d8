"""Backends: how a process group's transport is built, by name.

Built in: ``"tcp"`` (every pair of ranks over an authenticated TCP connection),
``"shm"`` (shared-memory rings; every rank must be on one host, else an error
naming the hosts) and ``"auto"`` (the default: decided from the host identities
the ranks publish at rendezvous: shm when all ranks share a host, tcp when no two
do, and in between a mixed transport: shm between same-host ranks, tcp across
hosts; tcp wherever shm is unsupported, e.g. not Linux x86-64). torch's names are
understood: ``"gloo"`` (torch's CPU backend, which nearly every CPU script names) means
``"auto"``, so a script ported by changing its imports gets shared memory within a host
rather than loopback TCP; ``"nccl"``, ``"mpi"`` and ``"ucc"`` are refused with a message
saying what to use.

A custom backend is a factory returning a :class:`~tandem.transport.base.Transport`;
the collective algorithms then run over it unchanged::

    def make(options: tandem.BackendOptions) -> tandem.transport.Transport:
        return CountingTransport(TcpTransport(...))

    tandem.Backend.register_backend("counting", make)
    tandem.init_process_group("counting", ...)

See ``examples/custom_backend.py`` for a complete, tested one.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from tandem.config import Settings
from tandem.errors import ArgumentError
from tandem.store.base import Store
from tandem.transport.base import Transport
from tandem.transport.mixed import MixedTransport, exchange_hosts, require_one_host, same_host
from tandem.transport.shm import ShmTransport, unsupported_reason
from tandem.transport.tcp import TcpTransport

__all__ = ["Backend", "BackendOptions", "DEFAULT_GROUP_ID", "resolve_backend"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendOptions:
    """Everything a backend factory needs to connect ``rank`` to its peers."""

    store: Store
    rank: int
    world_size: int
    host: str  # the address to listen on
    hostname: str
    secret: bytes
    settings: Settings
    advertise: str = ""  # the address peers dial, when ``host`` is a wildcard like 0.0.0.0
    # called once this rank's entry is in the store, before it waits for the others (init
    # starts its watchdog's thread there: the others then never wait for that start)
    published: Callable[[], None] | None = None


Factory = Callable[[BackendOptions], Transport]

DEFAULT_GROUP_ID = 0  # the default group's id: on one host its arena is made at init
HOST_ARENA_KEY = 1 << 61  # a group's per-host arena: its id with this bit, apart from group ids


def _tcp(options: BackendOptions, peers: list[int] | None = None,
         hosts: list[str] | None = None, lazy: bool = False) -> TcpTransport:
    return TcpTransport(options.rank, options.world_size, options.store, options.host,
                        options.secret, options.settings.connect_timeout,
                        options.settings.max_frame, options.hostname, options.settings.debug,
                        advertise=options.advertise, peers=peers, hosts=hosts, lazy=lazy,
                        published=None if hosts is not None else options.published)


def _shm_over(options: BackendOptions, peers: list[int], tcp: Transport | None) -> ShmTransport:
    settings = options.settings
    everyone = set(peers) | {options.rank}
    # the default group's arena over this host's ranks is made by their first rank at
    # init and rides with the sockets, so the first barrier hands over nothing: the whole
    # group's when one host holds the job, else the group's arena for this host
    key = DEFAULT_GROUP_ID if len(everyone) == options.world_size else (
        HOST_ARENA_KEY | DEFAULT_GROUP_ID)
    return ShmTransport(options.rank, options.world_size, options.store, options.secret,
                        peers=peers, hostname=options.hostname,
                        connect_timeout=settings.connect_timeout,
                        max_frame=settings.max_frame,
                        mailbox=None if tcp is None else tcp.mailbox,
                        first_arena=(key, settings.shm_chunk) if settings.shm_arena else None)


def _shm(options: BackendOptions) -> Transport:
    why = unsupported_reason()
    if why:
        raise ArgumentError(f"backend 'shm' is not available here: {why}; use 'auto' or 'tcp'")
    hosts = exchange_hosts(options.store, options.rank, options.world_size, options.hostname,
                           options.published)
    require_one_host(hosts)
    return _shm_over(options, list(range(options.world_size)), None)


def _auto(options: BackendOptions) -> Transport:
    """shm within a host, tcp across hosts (every rank of a host decides alike)."""
    if unsupported_reason():
        return _tcp(options)
    hosts = exchange_hosts(options.store, options.rank, options.world_size, options.hostname,
                           options.published)
    local = same_host(hosts, options.rank)
    if len(local) == options.world_size:
        return _shm_over(options, local, None)
    if len(local) == 1:
        # every rank picks the same set-up connections: first use wherever a host has many
        return _tcp(options, hosts=hosts, lazy=len(set(hosts)) < options.world_size)
    # same-host peers talk through shared memory only: no second (tcp) link to them
    tcp = _tcp(options, peers=[r for r in range(options.world_size) if r not in local],
               hosts=hosts, lazy=True)
    try:
        return MixedTransport(tcp, _shm_over(options, local, tcp))
    except BaseException:
        tcp.close()
        raise


class Backend:
    """Backend names, and the registry of backend factories."""

    TCP = "tcp"
    SHM = "shm"
    AUTO = "auto"
    GLOO = "gloo"
    _factories: dict[str, Factory] = {"tcp": _tcp, "shm": _shm, "auto": _auto}
    _refused = {
        "nccl": "NCCL drives GPUs; tandem moves CPU tensors",
        "mpi": "tandem does not use MPI; it runs under mpirun through its environment variables",
        "ucc": "UCC is not a tandem backend",
    }

    @classmethod
    def register_backend(cls, name: str, factory: Factory) -> None:
        """Register ``factory(options) -> Transport`` under ``name``."""
        if not isinstance(name, str) or not name:
            raise ArgumentError(f"backend name must be a non-empty str, got {name!r}")
        if not callable(factory):
            raise ArgumentError(f"backend {name!r} factory must be callable")
        cls._factories[name.lower()] = factory

    @classmethod
    def factory(cls, name: str) -> Factory:
        return cls._factories[name]


def resolve_backend(backend: str | None) -> str:
    """Map a user-given backend name (torch's too) to a registered tandem backend."""
    if backend is None or backend == "":
        return Backend.AUTO
    if not isinstance(backend, str):
        raise ArgumentError(f"backend must be a str, got {type(backend).__name__}")
    name = backend.lower()
    if ":" in name:  # torch's "cpu:gloo,cuda:nccl": tandem serves the CPU part
        parts = dict(p.split(":", 1) for p in name.split(",") if ":" in p)
        if "cpu" not in parts:
            raise ArgumentError(f"backend {backend!r} names no CPU backend; use 'auto' or 'tcp'")
        name = parts["cpu"]
    if name == "gloo":
        return Backend.AUTO
    if name in Backend._factories:
        return name
    why = Backend._refused.get(name, "it is not registered")
    raise ArgumentError(
        f"backend {backend!r} is not available ({why}); use 'auto' (default), 'shm' or 'tcp', "
        f"or register one with tandem.Backend.register_backend"
    )
