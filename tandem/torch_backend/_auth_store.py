"""An authenticated rendezvous store for torch: tandem's TCPStore as a ``torch.distributed.Store``.

torch's own TCPStore, which ``env://`` and ``tcp://`` give every backend, has no
authentication: anyone who can reach its port can read and write the rendezvous
(addresses, ranks) and so join or disturb the job. :class:`AuthenticatedStore` serves
the same calls over tandem's TCPStore, whose every connection proves the job secret
(HMAC challenge-response; the traffic itself is not encrypted).

Three ways to use it, once ``tandem.torch_backend`` is imported:

* ``init_method="tandem://HOST:PORT"`` (``?rank=R&world_size=N``, or ``RANK``/``WORLD_SIZE``);
* by default for ``env://`` and ``tcp://`` when the job secret is given
  (``TANDEM_SECRET`` or ``TANDEM_SECRET_FILE``, which ``tandemrun`` always sets),
  unless torchrun's agent serves the store (``TORCHELASTIC_USE_AGENT_STORE=True``):
  then every rank must speak torch's protocol and torch's store is used;
* ``store=AuthenticatedStore(host, port, world_size, is_master=(rank == 0))``.

Every rank of a job must use the same kind of store: a rank with the secret given and
one without would not understand each other's store.
"""

from __future__ import annotations

import datetime
import importlib
import os
from typing import Any, Callable, Iterator, Sequence
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from tandem.collectives.cluster_env import env_int
from tandem.config import MAX_WORLD_SIZE, secret_configured
from tandem.errors import ArgumentError
from tandem.store.tcp import TCPStore

__all__ = ["AuthenticatedStore", "register_rendezvous"]

SCHEME = "tandem"
# Stores made by a rendezvous, held for the life of the process: torch keeps only the
# C++ half of a Python Store subclass, and a call after the Python half is collected
# fails ("Tried to call pure virtual function"). One connection per rendezvous.
_held: list["AuthenticatedStore"] = []


class AuthenticatedStore(dist.Store):
    """torch's ``Store`` calls served by tandem's authenticated :class:`TCPStore`.

    Passed as ``store=``, keep a reference to it while torch uses it: torch holds only
    its C++ half, and calls fail once the Python object is collected."""

    def __init__(self, host_name: str, port: int, world_size: int | None = None,
                 is_master: bool = False,
                 timeout: datetime.timedelta | float = default_pg_timeout,
                 wait_for_workers: bool = True, *, secret: bytes | str | None = None) -> None:
        super().__init__()
        # several stores on one port in a process (a group re-created) share the server
        self.store = TCPStore(host_name, port, world_size, is_master, timeout,
                              wait_for_workers, multi_tenant=True, secret=secret)
        self.host = host_name
        self.port = self.store.port

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        return self.store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        return self.store.compare_set(key, expected_value, desired_value)

    def append(self, key: str, value: str | bytes) -> None:
        self.store.append(key, value)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self.store.multi_get(keys)

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self.store.multi_set(keys, values)

    def has_extended_api(self) -> bool:
        return True

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        self.store.wait(list(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self.store.check(list(keys))

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(key)

    def num_keys(self) -> int:
        return self.store.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.store.set_timeout(timeout)

    def close(self) -> None:
        self.store.close()


def _rank_and_size(query: dict[str, list[str]], what: str) -> tuple[int, int]:
    def one(name: str, variable: str, low: int, expected: str) -> int:
        if name in query:
            text = query[name][0]
            if not text.strip().isdigit():
                raise ArgumentError(f"{what}: ?{name}={text!r} in the init_method is not a "
                                    f"non-negative integer")
            return int(text)
        if os.environ.get(variable) is None:
            raise ArgumentError(f"{what}: no {name} (give ?{name}= in the init_method, the "
                                f"argument {name}=, or the environment variable {variable})")
        return env_int(os.environ, variable, low, MAX_WORLD_SIZE - low, expected)
    size = one("world_size", "WORLD_SIZE", 1, f"the number of ranks, 1..{MAX_WORLD_SIZE}")
    rank = one("rank", "RANK", 0, f"this process's rank, 0..{MAX_WORLD_SIZE - 1}")
    if not 0 <= rank < size:
        raise ArgumentError(f"{what}: rank {rank} is not below the world size {size} (check "
                            f"RANK and WORLD_SIZE, or the init_method's rank= and world_size=)")
    return rank, size


def _url_port(url: str, what: str) -> int | None:
    try:
        return urlparse(url).port
    except ValueError as exc:  # urllib: "Port out of range 0-65535" or not a number
        raise ArgumentError(f"{what}: the port of {url!r} must be an integer, 1..65535 "
                            f"({exc})") from exc


def _rendezvous(url: str, timeout: datetime.timedelta, host: str | None, port: int | None,
                what: str) -> Iterator[tuple[dist.Store, int, int]]:
    rank, size = _rank_and_size(parse_qs(urlparse(url).query), what)
    if not host or port is None:
        raise ArgumentError(f"{what}: needs a host and a port, got {url!r}")
    store = AuthenticatedStore(host, port, size, rank == 0, timeout)
    _held.append(store)
    yield store, rank, size
    raise ArgumentError(f"{what}: a job cannot re-rendezvous through {url!r}")


def _tandem_handler(url: str, timeout: datetime.timedelta = default_pg_timeout,
                    **kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
    what = "tandem:// rendezvous"
    return _rendezvous(url, timeout, urlparse(url).hostname, _url_port(url, what), what)


def _torch_protocol() -> bool:
    """Whether the store must be torch's: no job secret given, or torchrun's agent serves it."""
    return not secret_configured() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _preferring_authenticated(scheme: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def handler(url: str, timeout: datetime.timedelta = default_pg_timeout,
                **kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
        if _torch_protocol():
            return original(url, timeout, **kwargs)
        if scheme == "env":
            host = os.environ.get("MASTER_ADDR")
            port = os.environ.get("MASTER_PORT")
            if not host or not port:
                raise ArgumentError(f"env:// rendezvous: the environment variables MASTER_ADDR "
                                    f"and MASTER_PORT are needed, got MASTER_ADDR={host!r}, "
                                    f"MASTER_PORT={port!r}")
            number = env_int(os.environ, "MASTER_PORT", 0, 65535,
                             "a TCP port, 1..65535 (0 on rank 0: any free port)")
            return _rendezvous(url, timeout, host, number,
                               "env:// rendezvous (tandem's authenticated store)")
        what = "tcp:// rendezvous (tandem's authenticated store)"
        return _rendezvous(url, timeout, urlparse(url).hostname, _url_port(url, what), what)

    handler.tandem_original = original  # type: ignore[attr-defined]
    return handler


def register_rendezvous() -> None:
    """Register ``tandem://`` and route ``env://``/``tcp://`` (once; see the module doc)."""
    # the module: torch.distributed.rendezvous as an attribute is a function of it
    module = importlib.import_module("torch.distributed.rendezvous")
    handlers: dict[str, Callable[..., Any]] = module._rendezvous_handlers
    if SCHEME not in handlers:
        dist.register_rendezvous_handler(SCHEME, _tandem_handler)
    for scheme in ("env", "tcp"):
        current = handlers.get(scheme)
        if current is not None and not hasattr(current, "tandem_original"):
            # torch offers no public way to replace a scheme's handler
            handlers[scheme] = _preferring_authenticated(scheme, current)
