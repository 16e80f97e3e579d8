"""Nothing named outlives a job: no /dev/shm file, no socket, after exit, exception or kill.

Rings are memfds (no name ever) or, on the fallback path, /dev/shm files unlinked
right after creation, before any peer maps them; sockets live in the abstract
namespace (no file) and vanish with their processes. A full or unwritable segment
directory fails with a message that names the directory and the cause.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from typing import Any

import pytest

from _shm_fault_ranks import exits_normally
from tandem.errors import NetworkError
from tandem._proc import process_alive
from tandem.testing import launch
from tandem.transport import _shmem

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]


def tandem_shm_names() -> set[str]:
    """tandem's /dev/shm files, but those of a process that still runs: another job's
    segment lives there for a moment before its unlink (tests run several files at once)."""
    return {n for n in os.listdir("/dev/shm") if "tandem" in n and not _owner_runs(n)}


def _owner_runs(name: str) -> bool:
    pid = name.removeprefix("tandem-shm-").partition("-")[0]
    return pid.isdigit() and process_alive(int(pid))


def abstract_sockets() -> set[str]:
    with open("/proc/net/unix") as f:
        return {ln.split()[-1] for ln in f if ln.split()[-1].startswith("@tandem-shm-")}


@pytest.fixture(scope="module", params=[("shm", False), ("shm", True), ("shm-devshm", False),
                                        ("shm-devshm", True)],
                ids=["memfd-exit", "memfd-exception", "devshm-exit", "devshm-exception"])
def job(request: Any, tmp_path_factory: Any) -> dict[str, Any]:
    backend, fail = request.param
    tmp = tmp_path_factory.mktemp("job")
    before = tandem_shm_names()
    outcomes = launch(3, exits_normally, (backend, str(tmp / "store"), fail), init=False,
                      timeout=90)
    names = {n for o in outcomes if o.ok for n in o.value["sockets"]}
    assert names, "no rank reported its job's socket names"
    return {"backend": backend, "fail": fail, "outcomes": outcomes,
            "new_names": tandem_shm_names() - before, "sockets": names}


def test_the_job_ran_and_failed_only_where_asked(job: Any) -> None:
    for o in job["outcomes"]:
        assert o.ok == (not (job["fail"] and o.rank == 1)), (o.rank, o.error)


def test_nothing_is_left_in_dev_shm(job: Any) -> None:
    assert not job["new_names"], job["new_names"]


def test_no_socket_of_the_job_outlives_it(job: Any) -> None:
    alive = {"@" + n for n in job["sockets"]} & abstract_sockets()
    assert not alive, alive


def test_rings_are_mapped_without_names_and_no_descriptor_is_leaked(job: Any) -> None:
    for o in job["outcomes"]:
        if not o.ok:
            continue
        maps = o.value["maps"]
        # no ring: a ring is made on a pair's first message, and the all_reduce and the
        # barrier go through the default group's staging arena (one segment for all)
        assert len(maps) == 1, maps
        assert all(m.endswith("(deleted)") for m in maps), maps
        if job["backend"] == "shm":
            rings = [m for m in maps if m.startswith("/memfd:tandem-ring")]
            arenas = [m for m in maps if m.startswith("/memfd:tandem-arena")]
            assert (len(rings), len(arenas)) == (0, 1), maps
        else:
            assert all(m.startswith("/dev/shm/tandem-shm-") for m in maps), maps
        # CPython's mmap keeps a dup of its descriptor: one per mapping, and the arena's
        # own while its staging is partly reserved (the 12 MB all_reduce read the peers'
        # memory directly), no other; none once the group is destroyed
        held = maps[:1] if o.value["reserving"] else []
        assert sorted(o.value["fds"]) == sorted(maps + held), (o.rank, o.value["fds"], maps)
        assert o.value["fds_after"] == [], (o.rank, o.value["fds_after"])


def test_a_missing_directory_is_named_with_its_cause(tmp_path: Any) -> None:
    with pytest.raises(NetworkError, match=r"no-such-dir.*No such file or directory"):
        _shmem.create_segment(1 << 20, str(tmp_path / "no-such-dir"))


def test_a_full_directory_says_it_is_full(tiny_tmpfs: Any) -> None:
    with pytest.raises(NetworkError, match=r"is full") as info:
        _shmem.create_segment(1 << 20, str(tiny_tmpfs))
    assert str(tiny_tmpfs) in str(info.value) and "No space left" in str(info.value)
    assert not os.listdir(tiny_tmpfs), "the failed segment was left behind"


def test_a_read_only_directory_is_named_with_its_cause(tiny_tmpfs: Any) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True)
    with pytest.raises(NetworkError, match=r"Read-only file system.*writable"):
        _shmem.create_segment(4096, str(tiny_tmpfs))


def test_stale_segments_of_dead_processes_are_swept(tmp_path: Any) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"tandem-shm-{dead.pid}-abc"
    live = tmp_path / f"tandem-shm-{os.getpid()}-abc"
    other = tmp_path / "unrelated"
    for p in (stale, live, other):
        p.write_bytes(b"x")
    assert _shmem.sweep_stale(str(tmp_path)) == 1
    assert not stale.exists() and live.exists() and other.exists()


def test_memfd_segments_are_reserved_up_front() -> None:
    fd = _shmem.create_segment(1 << 20)
    try:
        assert os.fstat(fd).st_size == 1 << 20
        assert os.fstat(fd).st_blocks * 512 >= 1 << 20  # allocated, not sparse: no SIGBUS later
    finally:
        os.close(fd)
