"""A tandem :class:`~tandem.store.base.Store` over the store torch hands a backend.

torch gives each process group's backend factory its own ``torch.distributed.Store``
(a ``PrefixStore`` over the job's TCPStore or FileStore). tandem's transports
rendezvous through tandem's ``Store`` seam, so this adapter forwards each call,
keeps tandem's deadlines (every blocking call waits at most until its deadline,
whatever the torch store's own timeout is) and translates torch's store errors into
tandem's.
"""

from __future__ import annotations

import datetime
import time
from typing import Callable, TypeVar

import torch.distributed as dist

from tandem.errors import StoreError
from tandem.store.base import Store

__all__ = ["TorchStore", "master_address"]

T = TypeVar("T")


class TorchStore(Store):
    """tandem's store API over ``store`` (a ``torch.distributed.Store``)."""

    def __init__(self, store: dist.Store, timeout: float) -> None:
        super().__init__(timeout)
        self.torch_store = store

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (RuntimeError, OSError) as exc:  # torch's DistStoreError is a RuntimeError
            raise StoreError(f"torch store {what} failed: {exc}") from exc

    def _set(self, key: str, value: bytes) -> None:
        put = self.torch_store.set  # torch's stub says str; its binding takes bytes as well
        self._call(f"set {key!r}", lambda: put(key, value))  # type: ignore[arg-type]

    def _get(self, key: str, deadline: float, seconds: float) -> bytes:
        self._wait([key], deadline, seconds)
        return bytes(self._call(f"get {key!r}", lambda: self.torch_store.get(key)))

    def _add(self, key: str, amount: int) -> int:
        return int(self._call(f"add {key!r}", lambda: self.torch_store.add(key, amount)))

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        # torch's stub says str; its binding takes bytes as well
        swap = self.torch_store.compare_set
        return bytes(self._call(f"compare_set {key!r}",
                                lambda: swap(key, expected, desired)))  # type: ignore[arg-type]

    def _append_value(self, key: str, value: bytes) -> None:
        # torch's stub lacks append (its binding has it, taking bytes as well as str)
        extend: Callable[[str, bytes], None] = self.torch_store.append  # type: ignore[attr-defined]
        self._call(f"append {key!r}", lambda: extend(key, value))

    def _wait(self, keys: list[str], deadline: float, seconds: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0 and not self._check(keys):
            raise self._timed_out(keys, seconds)
        try:
            self.torch_store.wait(keys, datetime.timedelta(seconds=max(left, 0.001)))
        except (RuntimeError, OSError) as exc:
            if time.monotonic() >= deadline - 0.01 or "timeout" in str(exc).lower():
                raise self._timed_out(keys, seconds) from exc
            raise StoreError(f"torch store wait for {keys} failed: {exc}") from exc

    def _check(self, keys: list[str]) -> bool:
        return bool(self._call(f"check {keys}", lambda: self.torch_store.check(keys)))

    def _delete(self, key: str) -> bool:
        return bool(self._call(f"delete_key {key!r}", lambda: self.torch_store.delete_key(key)))

    def _num_keys(self) -> int:
        return int(self._call("num_keys", self.torch_store.num_keys))


def master_address(store: dist.Store) -> str | None:
    """The host of the TCPStore under ``store`` (through its PrefixStores), if any.

    Ranks listen on the interface that routes to it, as tandem's own init does with
    ``MASTER_ADDR``; a ``tcp://`` init method leaves that variable unset.
    """
    seen = 0
    while isinstance(store, dist.PrefixStore) and seen < 64:  # bounded: stores nest shallowly
        store = store.underlying_store
        seen += 1
    if isinstance(store, dist.TCPStore):
        return str(store.host)
    host = getattr(store, "host", None)  # an AuthenticatedStore (tandem's store under torch)
    return host if isinstance(host, str) else None
