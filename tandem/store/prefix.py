"""PrefixStore: a namespace inside another store."""

from __future__ import annotations

from tandem.errors import ArgumentError
from tandem.store.base import Store, check_store

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """Every key is stored as ``prefix + "/" + key`` in ``store``."""

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(prefix, str):
            raise ArgumentError(f"PrefixStore: prefix must be a str, got {type(prefix).__name__}")
        check_store("PrefixStore", store)
        super().__init__(store._timeout)
        self.prefix = prefix
        self.underlying_store = store

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def _set(self, key: str, value: bytes) -> None:
        self.underlying_store._set(self._k(key), value)

    def _get(self, key: str, deadline: float, seconds: float) -> bytes:
        return self.underlying_store._get(self._k(key), deadline, seconds)

    def _add(self, key: str, amount: int) -> int:
        return self.underlying_store._add(self._k(key), amount)

    def _append_value(self, key: str, value: bytes) -> None:
        self.underlying_store._append_value(self._k(key), value)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self.underlying_store._compare_set(self._k(key), expected, desired)

    def _wait(self, keys: list[str], deadline: float, seconds: float) -> None:
        self.underlying_store._wait([self._k(k) for k in keys], deadline, seconds)

    def _check(self, keys: list[str]) -> bool:
        return self.underlying_store._check([self._k(k) for k in keys])

    def _delete(self, key: str) -> bool:
        return self.underlying_store._delete(self._k(key))

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self.underlying_store._multi_set([self._k(k) for k in keys], values)

    def _multi_get(self, keys: list[str], deadline: float, seconds: float) -> list[bytes]:
        return self.underlying_store._multi_get([self._k(k) for k in keys], deadline, seconds)

    def _num_keys(self) -> int:
        # like torch, the count is the underlying store's: keys are not enumerable
        return self.underlying_store._num_keys()
