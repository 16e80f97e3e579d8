"""FileStore beyond the Store contract: processes, file lifetime, torn records."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import _store_children as children
import pytest

from tandem.errors import ArgumentError, StateError, StoreError
from tandem.store import FileStore
from tandem.store import file as file_module

CHILD_START = 20.0  # a spawned child imports torch: about 2s idle, more on a busy machine


@pytest.mark.procs
def test_two_processes_share_a_store(tmp_path: Path, spawn: Any) -> None:
    path = str(tmp_path / "store")
    adds = 50
    with FileStore(path, timeout=5) as store:
        child = spawn(children.file_worker, path, adds)
        store.set("parent", b"from parent")
        for _ in range(adds):
            store.add("counter", 1)
        store.wait(["child"], timeout=CHILD_START)
        assert store.get("child") == b"\x00from child\x00"
        child.join(CHILD_START)
        assert child.exitcode == 0
        assert store.get("counter") == str(2 * adds).encode()


def test_file_is_private_to_the_user(tmp_path: Path) -> None:
    with FileStore(tmp_path / "store", timeout=1):
        mode = stat.S_IMODE(os.stat(tmp_path / "store").st_mode)
    assert mode & 0o077 == 0


def test_world_size_th_close_removes_the_file(tmp_path: Path) -> None:
    path = tmp_path / "store"
    first = FileStore(path, world_size=2, timeout=1)
    second = FileStore(path, world_size=2, timeout=1)
    first.set("k", b"v")
    first.close()
    assert path.exists()
    assert second.get("k") == b"v"
    assert second.num_keys() == 1  # the close counter is internal
    second.close()
    assert not path.exists()


def test_unknown_world_size_keeps_the_file(tmp_path: Path) -> None:
    path = tmp_path / "store"
    FileStore(path, timeout=1).close()
    assert path.exists()


def test_torn_record_of_a_dead_writer_is_ignored_and_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with FileStore(path, timeout=1) as store:
        store.set("before", b"1")
        with open(path, "ab") as f:
            f.write(b"S\x00\x00\x00\x05\x00\x00\x10\x00parti")  # header promises more bytes
        store.set("after", b"2")
        with FileStore(path, timeout=1) as reader:
            assert reader.multi_get(["before", "after"]) == [b"1", b"2"]


def test_closed_store_raises_state_error(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store", timeout=1)
    store.close()
    store.close()  # idempotent
    with pytest.raises(StateError):
        store.set("k", b"v")


@pytest.mark.parametrize("world_size", [0, -2, True])
def test_bad_world_size_raises_argument_error(tmp_path: Path, world_size: Any) -> None:
    with pytest.raises(ArgumentError, match="world_size"):
        FileStore(tmp_path / "store", world_size=world_size)


@pytest.mark.parametrize("file_name", [None, "", 3])
def test_a_file_name_that_is_not_a_path_is_refused(file_name: Any) -> None:
    with pytest.raises(ArgumentError, match="file_name must be a path"):
        FileStore(file_name)


@pytest.mark.parametrize("kind", ["fifo", "directory", "device", "link to a device"])
def test_a_path_that_is_not_a_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    # FileStore("/dev/null", world_size=1) took it, and its close() would unlink /dev/null
    path = tmp_path / "special"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "device":
        path = Path("/dev/null")
    else:
        path.symlink_to("/dev/null")
    with pytest.raises((ArgumentError, StoreError), match="is not a regular file|Is a directory"):
        FileStore(path)  # world_size -1: nothing is ever unlinked, with or without the check
    assert Path("/dev/null").exists()


def test_a_waiter_polls_at_least_every_10_ms(tmp_path: Path, monkeypatch: Any) -> None:
    # a rank waiting for the last one to publish its key oversleeps it by at most one
    # pause between polls: init waits on the store three times, and 50 ms pauses cost
    # 30-45 ms of every rank's rendezvous at 32 ranks
    pauses: list[float] = []
    sleep = time.sleep

    def recorded(seconds: float) -> None:
        if threading.current_thread() is threading.main_thread():
            pauses.append(seconds)
        sleep(seconds)

    with FileStore(tmp_path / "store", timeout=30) as store:
        late = threading.Timer(0.3, lambda: FileStore(tmp_path / "store").set("late", b"1"))
        monkeypatch.setattr(file_module.time, "sleep", recorded)
        late.start()
        try:
            assert store.get("late") == b"1"
        finally:
            late.join()
    assert len(pauses) > 5 and max(pauses) <= 0.010, pauses


def test_multi_get_and_multi_set_lock_the_file_once(tmp_path: Path, monkeypatch: Any) -> None:
    """A rank reads every rank's key at init: one lock and one replay of the file for
    all of them, not one per key; keys that appear late are all waited for together."""
    keys = [f"rank/{r}" for r in range(16)]
    with FileStore(tmp_path / "store", timeout=30) as store:
        locks: list[int] = []
        flock = file_module.fcntl.flock

        def counted(fd: int, how: int) -> None:
            if how != file_module.fcntl.LOCK_UN:
                locks.append(how)
            flock(fd, how)

        monkeypatch.setattr(file_module.fcntl, "flock", counted)
        store.multi_set(keys[:8], [str(r).encode() for r in range(8)])
        assert len(locks) == 1, f"multi_set of 8 keys took {len(locks)} locks"
        def write_late() -> None:
            with FileStore(tmp_path / "store") as other:
                other.multi_set(keys[8:], [str(r).encode() for r in range(8, 16)])

        late = threading.Timer(0.2, write_late)
        late.start()
        try:
            assert store.multi_get(keys) == [str(r).encode() for r in range(16)]
        finally:
            late.join(30)
        assert not late.is_alive(), "the late writer did not finish"
        del locks[:]
        assert store.multi_get(keys) == [str(r).encode() for r in range(16)]
        assert len(locks) == 1, f"multi_get of 16 present keys took {len(locks)} locks"


def test_a_key_or_value_longer_than_a_record_holds_is_refused_before_writing(
        tmp_path: Path, monkeypatch: Any) -> None:
    # past 4 GiB, struct.pack failed with "argument out of range"; the bound is lowered
    # here so the test need not allocate that much
    monkeypatch.setattr(file_module, "MAX_FIELD", 8)
    store = FileStore(tmp_path / "s", timeout=2)
    for call in (lambda: store.set("k", b"x" * 9), lambda: store.set("k" * 9, b"x"),
                 lambda: store.multi_set(["a", "b"], [b"1", b"x" * 9]),
                 lambda: store.compare_set("c", b"", b"x" * 9)):
        with pytest.raises(ArgumentError, match="FileStore: (key|value) size=9 is above its limit of 8"):
            call()
    store.append("d", b"x" * 5)
    with pytest.raises(ArgumentError, match="above its limit of 8"):
        store.append("d", b"x" * 5)  # the whole value, 10 bytes, is one record
    assert not store.check(["a"]) and store.get("d") == b"x" * 5
    store.close()
