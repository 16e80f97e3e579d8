"""HashStore: an in-process store, for tests and for threads of one process."""

from __future__ import annotations

import datetime
import threading
import time

from tandem.errors import ArgumentError
from tandem.store.base import Store

__all__ = ["HashStore"]


class HashStore(Store):
    def __init__(self, timeout: float | datetime.timedelta | None = None) -> None:
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def _set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def _await(self, keys: list[str], deadline: float, seconds: float) -> None:
        # caller holds self._cond
        while not all(k in self._data for k in keys):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timed_out([k for k in keys if k not in self._data], seconds)
            self._cond.wait(remaining)

    def _get(self, key: str, deadline: float, seconds: float) -> bytes:
        with self._cond:
            self._await([key], deadline, seconds)
            return self._data[key]

    def _add(self, key: str, amount: int) -> int:
        with self._cond:
            current = self._data.get(key, b"0")
            try:
                value = int(current) + amount
            except ValueError as exc:
                raise ArgumentError(f"store key {key!r} does not hold an integer") from exc
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def _append_value(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = self._data.get(key, b"") + value
            self._cond.notify_all()

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._cond:
            current = self._data.get(key)
            if current is None:
                if expected:
                    return expected
            elif current != expected:
                return current
            self._data[key] = desired
            self._cond.notify_all()
            return desired

    def _wait(self, keys: list[str], deadline: float, seconds: float) -> None:
        with self._cond:
            self._await(keys, deadline, seconds)

    def _check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def _delete(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

    def _num_keys(self) -> int:
        with self._cond:
            return len(self._data)
