"""The ``Store`` seam: a small key-value service that ranks rendezvous through.

Public methods validate their arguments and translate deadlines; each store
implements the private ``_``-methods. Values are bytes; ``str`` values are
UTF-8 encoded. Counters made by :meth:`Store.add` are stored as decimal text, so
``get`` on them returns e.g. ``b"3"`` (as torch's stores do).
"""

from __future__ import annotations

import abc
import datetime
import time
from typing import Iterable, Sequence

from tandem._words import secs
from tandem.config import timeout_seconds
from tandem.errors import ArgumentError, StoreTimeoutError

__all__ = ["Store", "DEFAULT_STORE_TIMEOUT", "check_store"]

DEFAULT_STORE_TIMEOUT = 300.0
KEYS_SHOWN, KEY_SHOWN = 16, 200  # missing keys a timeout names, characters of each


# torch's counters are int64_t; a larger amount is refused there, and past 4300 digits
# Python's int() refuses to read a counter back
INT64 = (-(1 << 63), (1 << 63) - 1)


def _utf8(text: str, what: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError as exc:  # a lone surrogate: HashStore took it, the others failed
        raise ArgumentError(f"store {what} {text!r} is not valid UTF-8 text ({exc.reason} at "
                            f"position {exc.start}); give text without lone surrogates"
                            f"{', or bytes' if what == 'value' else ''}") from None


def _key(key: object) -> str:
    if not isinstance(key, str):
        raise ArgumentError(f"store keys are str, got {type(key).__name__}")
    _utf8(key, "key")
    return key


def _value(value: object) -> bytes:
    if isinstance(value, str):
        return _utf8(value, "value")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        if not all(0 <= v <= 255 for v in value):
            bad = next(v for v in value if not 0 <= v <= 255)
            raise ArgumentError(f"a store value given as a list holds byte values 0..255, "
                                f"got {bad}")
        return bytes(value)  # torch accepts a list of byte values
    raise ArgumentError(f"store values are str or bytes, got {type(value).__name__}")


def check_store(what: str, store: object) -> None:
    """Refuse anything but a tandem store, naming torch's stores (a half-ported script)."""
    if not isinstance(store, Store):
        kind = type(store)
        got = (f"torch.distributed's {kind.__name__}; make it with tandem.{kind.__name__} "
               f"instead" if kind.__module__.startswith("torch") else kind.__name__)
        raise ArgumentError(f"{what} takes a tandem store (TCPStore, FileStore, HashStore, "
                            f"PrefixStore), got {got}")


class Store(abc.ABC):
    """Key-value store with blocking ``get``/``wait`` bounded by a deadline."""

    def __init__(self, timeout: float | datetime.timedelta | None = None) -> None:
        self._timeout = timeout_seconds(timeout, DEFAULT_STORE_TIMEOUT)

    # -- public API, mirrors torch.distributed.Store ---------------------------------
    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self._timeout)

    def set_timeout(self, timeout: float | datetime.timedelta) -> None:
        self._timeout = timeout_seconds(timeout, self._timeout)

    def set(self, key: str, value: str | bytes) -> None:
        self._set(_key(key), _value(value))

    def get(self, key: str) -> bytes:
        """Return the value of ``key``, waiting up to the store timeout for it to appear."""
        key = _key(key)
        return self._get(key, self._deadline(None), self._timeout)

    def add(self, key: str, amount: int) -> int:
        if not isinstance(amount, int) or isinstance(amount, bool):
            raise ArgumentError(f"add amount must be int, got {type(amount).__name__}")
        if not INT64[0] <= amount <= INT64[1]:
            # a number past 4300 digits cannot even be printed, so its size is named
            raise ArgumentError(f"add amount (a {amount.bit_length()}-bit int) is outside a "
                                f"64-bit counter's range [{INT64[0]}, {INT64[1]}] (torch's "
                                f"stores count in int64)")
        return self._add(_key(key), amount)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """Set ``key`` to ``desired_value`` if it currently holds ``expected_value``.

        A missing key matches an empty ``expected_value``. Returns the value the key
        holds afterwards (``expected_value`` itself if the key is missing and the
        expectation was not empty).
        """
        return self._compare_set(_key(key), _value(expected_value), _value(desired_value))

    def wait(
        self, keys: Sequence[str], timeout: float | datetime.timedelta | None = None
    ) -> None:
        if isinstance(keys, str):
            raise ArgumentError("wait takes a list of keys, got a single str")
        key_list = [_key(k) for k in keys]
        seconds = timeout_seconds(timeout, self._timeout, "wait: timeout")
        self._wait(key_list, time.monotonic() + seconds, seconds)

    def check(self, keys: Sequence[str]) -> bool:
        if isinstance(keys, str):
            raise ArgumentError("check takes a list of keys, got a single str")
        return self._check([_key(k) for k in keys])

    def append(self, key: str, value: str | bytes) -> None:
        """Add ``value`` to the end of ``key``'s value, creating the key if it is missing;
        atomic, so concurrent appends all land."""
        self._append_value(_key(key), _value(value))

    def has_extended_api(self) -> bool:
        """Whether ``append``, ``multi_get`` and ``multi_set`` work (always, in tandem)."""
        return True

    def delete_key(self, key: str) -> bool:
        return self._delete(_key(key))

    def num_keys(self) -> int:
        return self._num_keys()

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Set every ``keys[i]`` to ``values[i]`` (one round trip on a TCPStore)."""
        if isinstance(keys, str):
            raise ArgumentError("multi_set takes a list of keys, got a single str")
        if len(keys) != len(values):
            raise ArgumentError(f"multi_set got {len(keys)} keys but {len(values)} values")
        self._multi_set([_key(k) for k in keys], [_value(v) for v in values])

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, in order, waiting up to the store timeout for all of
        them to appear (one round trip on a TCPStore)."""
        if isinstance(keys, str):
            raise ArgumentError("multi_get takes a list of keys, got a single str")
        key_list = [_key(k) for k in keys]
        return self._multi_get(key_list, self._deadline(None), self._timeout)

    def close(self) -> None:
        """Release connections or files; the store is unusable afterwards."""

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers for implementations --------------------------------------------------
    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self._timeout if timeout is None else timeout)

    @staticmethod
    def _timed_out(keys: Iterable[str], seconds: float) -> StoreTimeoutError:
        # a wait on a million keys, or on a 64 MiB key, made a message of as many bytes
        missing = list(keys)
        names = ", ".join(repr(k if len(k) <= KEY_SHOWN else k[:KEY_SHOWN] + "...")
                          for k in missing[:KEYS_SHOWN])
        if len(missing) > KEYS_SHOWN:
            names += f" and {len(missing) - KEYS_SHOWN} more"
        return StoreTimeoutError(f"store keys {names} did not appear within {secs(seconds)}s")

    # -- what each store implements ---------------------------------------------------
    @abc.abstractmethod
    def _set(self, key: str, value: bytes) -> None: ...

    @abc.abstractmethod
    def _get(self, key: str, deadline: float, seconds: float) -> bytes:
        """Return the value, waiting until ``deadline`` (monotonic) for the key."""

    @abc.abstractmethod
    def _add(self, key: str, amount: int) -> int: ...

    @abc.abstractmethod
    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes: ...

    @abc.abstractmethod
    def _append_value(self, key: str, value: bytes) -> None: ...

    @abc.abstractmethod
    def _wait(self, keys: list[str], deadline: float, seconds: float) -> None:
        """Return once every key exists; raise ``_timed_out`` after ``deadline``."""

    @abc.abstractmethod
    def _check(self, keys: list[str]) -> bool: ...

    @abc.abstractmethod
    def _delete(self, key: str) -> bool: ...

    @abc.abstractmethod
    def _num_keys(self) -> int: ...

    # stores that can batch (TCPStore) override these; the others go key by key
    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        for k, v in zip(keys, values):
            self._set(k, v)

    def _multi_get(self, keys: list[str], deadline: float, seconds: float) -> list[bytes]:
        return [self._get(k, deadline, seconds) for k in keys]
