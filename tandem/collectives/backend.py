"""Backends: how a process group's transport is built, by name.

Built in: ``"tcp"`` (every pair of ranks over an authenticated TCP connection) and
``"auto"`` (the default: picks the best transport for the topology; today that is
tcp). torch's names are understood: ``"gloo"`` runs on tcp, the closest match;
``"nccl"``, ``"mpi"`` and ``"ucc"`` are refused with a message saying what to use.

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
from tandem.transport.tcp import TcpTransport

__all__ = ["Backend", "BackendOptions", "resolve_backend"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendOptions:
    """Everything a backend factory needs to connect ``rank`` to its peers."""

    store: Store
    rank: int
    world_size: int
    host: str
    hostname: str
    secret: bytes
    settings: Settings


Factory = Callable[[BackendOptions], Transport]


def _tcp(options: BackendOptions) -> Transport:
    return TcpTransport(options.rank, options.world_size, options.store, options.host,
                        options.secret, options.settings.connect_timeout,
                        options.settings.max_frame, options.hostname)


class Backend:
    """Backend names, and the registry of backend factories."""

    TCP = "tcp"
    AUTO = "auto"
    GLOO = "gloo"
    _factories: dict[str, Factory] = {"tcp": _tcp, "auto": _tcp}
    _refused = {
        "nccl": "NCCL drives GPUs; tandem moves CPU tensors",
        "mpi": "tandem does not use MPI; it runs under mpirun through its environment variables",
        "ucc": "UCC is not a tandem backend",
        "shm": "the shared-memory backend is not available yet",
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
        return Backend.TCP
    if name in Backend._factories:
        return name
    why = Backend._refused.get(name, "it is not registered")
    raise ArgumentError(
        f"backend {backend!r} is not available ({why}); use 'auto' (default) or 'tcp', "
        f"or register one with tandem.Backend.register_backend"
    )
