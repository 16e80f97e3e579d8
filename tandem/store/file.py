"""FileStore: a store shared by the processes of one host through a file.

    store = FileStore("/tmp/job.store", world_size=2)   # the same path in every process
    store.set("addr", b"...");  store.get("addr")
    store.close()                                       # or use it in a ``with`` block

The file (created with mode 0600) is an append-only log of records
``op(1) key_length(4) value_length(4) key value``, op ``S`` for set and ``D`` for delete.
Each instance replays the records it has not seen yet into a private dict. Writers
replay and append under an exclusive ``flock``, so read-modify-write ops (add,
compare_set) are atomic across processes; readers take a shared one, so they never see
half a record. ``get``/``wait`` poll with short sleeps: there is nothing to block on
across processes, and a poll is an fstat plus, when the file grew, one read.

With ``world_size > 0`` each instance counts its ``close()`` in the file and the
``world_size``-th close deletes the file, as torch's FileStore does.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import stat
import struct
import threading
import time
import weakref
from typing import Iterator

from tandem.config import MAX_WORLD_SIZE, at_most
from tandem.errors import ArgumentError, StateError, StoreError
from tandem.store.base import Store

__all__ = ["FileStore"]

_HEADER = struct.Struct("!cII")
_SET, _DELETE = b"S", b"D"
MAX_FIELD = (1 << 32) - 1  # the largest key or value a record's length field holds
INTERNAL = "\x00tandem/"  # keys the store uses for itself; not counted by num_keys
_CLOSES = INTERNAL + "closes"
# seconds; the sleep doubles between polls up to the most a waiter oversleeps a key's
# arrival: init waits on the store three times, and 50 ms cost 30-45 ms of every rank's
# rendezvous at 32 ranks (the last rank arrived at 66 ms, the others left by 109 ms)
_POLL_FIRST, _POLL_MAX = 0.001, 0.01


def _check_sizes(keys: list[str], values: list[bytes]) -> None:
    """A record stores each length in 4 bytes: a longer key or value failed in
    struct.pack with "argument out of range", after the file was locked."""
    for key, value in zip(keys, values):
        for what, size in (("key", len(key.encode())), ("value", len(value))):
            at_most(f"FileStore: {what} size", size, MAX_FIELD,
                    "bytes, what a record's 4-byte length field holds",
                    "store large data in a file of its own and its path in the store")


def _refuse_special(path: str, st: os.stat_result) -> None:
    """A store lives in a regular file: FileStore("/dev/null", world_size=1) kept nothing
    between processes, and its last close() unlinked /dev/null for the whole host."""
    if not stat.S_ISREG(st.st_mode):
        raise ArgumentError(f"FileStore: {path!r} is not a regular file (mode "
                            f"{stat.filemode(st.st_mode)}); give the path of a new or store "
                            f"file, e.g. in a directory of the job's own")


class FileStore(Store):
    """A store in the file ``file_name``; see the module docstring."""

    def __init__(
        self,
        file_name: str | os.PathLike[str],
        world_size: int = -1,
        timeout: float | datetime.timedelta | None = None,
    ) -> None:
        super().__init__(timeout)
        bad = not isinstance(world_size, int) or isinstance(world_size, bool)
        if bad or world_size == 0 or world_size < -1:
            raise ArgumentError(f"world_size must be positive or -1 (unknown), got {world_size!r}")
        at_most("FileStore: world_size", world_size, MAX_WORLD_SIZE,
                "MAX_WORLD_SIZE, far beyond any job tandem serves",
                "give the number of processes that will use the store, or -1")
        if not isinstance(file_name, (str, os.PathLike)) or not os.fspath(file_name):
            raise ArgumentError(f"FileStore: file_name must be a path (str or os.PathLike), "
                                f"got {file_name!r}")
        self.path = os.fspath(file_name)
        self.world_size = world_size
        with contextlib.suppress(FileNotFoundError):
            _refuse_special(self.path, os.stat(self.path))  # before an open that may act
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as exc:
            raise StoreError(f"cannot open the store file {self.path!r}: {exc}") from exc
        try:
            _refuse_special(self.path, os.fstat(self._fd))  # what was opened, after a swap
        except ArgumentError:
            os.close(self._fd)
            raise
        # flock excludes other open files, not threads sharing this one
        self._lock = threading.Lock()
        self._closed = False
        self._data: dict[str, bytes] = {}
        self._offset = 0  # bytes of the log replayed into _data
        self._release_fd = weakref.finalize(self, os.close, self._fd)  # if never closed

    # -- log -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        """Hold the thread lock and the file lock, with ``_data`` brought up to date."""
        with self._lock:
            if self._closed:
                raise StateError(f"FileStore {self.path!r} is closed")
            fcntl.flock(self._fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                self._replay()
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _replay(self) -> None:
        size = os.fstat(self._fd).st_size
        if size <= self._offset:
            return
        chunk = os.pread(self._fd, size - self._offset, self._offset)
        pos = 0
        while pos + _HEADER.size <= len(chunk):
            op, key_len, value_len = _HEADER.unpack_from(chunk, pos)
            start = pos + _HEADER.size
            end = start + key_len + value_len
            if end > len(chunk):
                break  # a writer died mid-record; the next writer truncates the tail
            key = chunk[start : start + key_len].decode()
            if op == _SET:
                self._data[key] = chunk[start + key_len : end]
            elif op == _DELETE:
                self._data.pop(key, None)
            else:
                raise StoreError(f"store file {self.path!r} is corrupt at byte {self._offset + pos}")
            pos = end
        self._offset += pos

    def _append(self, op: bytes, key: str, value: bytes = b"") -> None:
        """Append one record; the caller holds the exclusive lock."""
        _check_sizes([key], [value])
        if os.fstat(self._fd).st_size != self._offset:
            os.ftruncate(self._fd, self._offset)  # drop a torn record of a dead writer
        raw_key = key.encode()
        record = memoryview(_HEADER.pack(op, len(raw_key), len(value)) + raw_key + value)
        while record:
            record = record[os.write(self._fd, record) :]
        self._offset = os.fstat(self._fd).st_size
        if op == _SET:
            self._data[key] = value
        else:
            self._data.pop(key, None)

    def _await(self, keys: list[str], deadline: float, seconds: float) -> list[bytes]:
        delay = _POLL_FIRST
        while True:
            with self._locked(exclusive=False):
                missing = [k for k in keys if k not in self._data]
                if not missing:
                    return [self._data[k] for k in keys]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timed_out(missing, seconds)
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _POLL_MAX)

    def _add_locked(self, key: str, amount: int) -> int:
        try:
            value = int(self._data.get(key, b"0")) + amount
        except ValueError as exc:
            raise ArgumentError(f"store key {key!r} does not hold an integer") from exc
        self._append(_SET, key, str(value).encode())
        return value

    # -- Store -----------------------------------------------------------------------
    def _set(self, key: str, value: bytes) -> None:
        with self._locked(exclusive=True):
            self._append(_SET, key, value)

    def _get(self, key: str, deadline: float, seconds: float) -> bytes:
        return self._await([key], deadline, seconds)[0]

    def _add(self, key: str, amount: int) -> int:
        with self._locked(exclusive=True):
            return self._add_locked(key, amount)

    def _append_value(self, key: str, value: bytes) -> None:
        with self._locked(exclusive=True):
            self._append(_SET, key, self._data.get(key, b"") + value)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._locked(exclusive=True):
            current = self._data.get(key)
            if current is None and expected:
                return expected
            if current is not None and current != expected:
                return current
            self._append(_SET, key, desired)
            return desired

    def _wait(self, keys: list[str], deadline: float, seconds: float) -> None:
        self._await(keys, deadline, seconds)

    # every key in one poll loop and one lock: key by key, a rank's read of 32 ranks'
    # host keys locked and replayed the file 32 times, and slept once per missing key
    def _multi_get(self, keys: list[str], deadline: float, seconds: float) -> list[bytes]:
        return self._await(keys, deadline, seconds)

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        _check_sizes(keys, values)  # all before the first is written
        with self._locked(exclusive=True):
            for k, v in zip(keys, values):
                self._append(_SET, k, v)

    def _check(self, keys: list[str]) -> bool:
        with self._locked(exclusive=False):
            return all(k in self._data for k in keys)

    def _delete(self, key: str) -> bool:
        with self._locked(exclusive=True):
            if key not in self._data:
                return False
            self._append(_DELETE, key)
            return True

    def _num_keys(self) -> int:
        with self._locked(exclusive=False):
            return sum(1 for k in self._data if not k.startswith(INTERNAL))

    def close(self) -> None:
        """Count this instance out; the ``world_size``-th close deletes the file."""
        if self._closed:
            return
        try:
            if self.world_size > 0:
                with self._locked(exclusive=True):
                    if self._add_locked(_CLOSES, 1) >= self.world_size:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(self.path)
        finally:
            with self._lock:
                if not self._closed:
                    self._closed = True
                    self._release_fd()
