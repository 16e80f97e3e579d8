"""Every size-like setting and argument has an upper bound that fits the machine.

A huge value must be refused where it enters, before anything is allocated for it,
with a message naming the setting, its value, the limit and what to do: one such value
(``TANDEM_SHM_CHUNK=2**32``) once ran the machine out of memory, and the kernel's OOM
killer stopped processes of other jobs. The table below holds every bounded setting; a
test checks that no numeric setting is missing from it (public arguments:
``test_argument_bounds.py``).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from tandem import config
from tandem.config import (MAX_SECRET_BYTES, MAX_WORLD_SIZE, Settings, flight_recorder_limit,
                           load_secret, load_settings, max_frame_limit, memory_limit,
                           shm_chunk_limit)
from tandem.errors import ArgumentError

LONGEST = threading.TIMEOUT_MAX

# setting -> (its limit, a value past it); the limits are the machine's own
SETTING_BOUNDS: dict[str, tuple[Callable[[], float], str]] = {
    "TANDEM_SHM_CHUNK": (shm_chunk_limit, str(2 * shm_chunk_limit())),
    "TANDEM_FLIGHT_RECORDER": (flight_recorder_limit, str(flight_recorder_limit() + 1)),
    "TANDEM_MAX_FRAME": (max_frame_limit, str(max_frame_limit() + 1)),
    "TANDEM_RING_THRESHOLD": (max_frame_limit, str(max_frame_limit() + 1)),
    "TANDEM_CHUNK_BYTES": (max_frame_limit, str(max_frame_limit() + 1)),
    "TANDEM_LINK_CHUNK_BYTES": (max_frame_limit, str(max_frame_limit() + 1)),
    "LOCAL_WORLD_SIZE": (lambda: MAX_WORLD_SIZE, str(MAX_WORLD_SIZE + 1)),
    "TANDEM_ELASTIC_MAX_RANKS": (lambda: MAX_WORLD_SIZE, str(MAX_WORLD_SIZE + 1)),
    "TANDEM_ELASTIC_MIN_NODES": (lambda: MAX_WORLD_SIZE, str(MAX_WORLD_SIZE + 1)),
    "TANDEM_STALL_WARN": (lambda: LONGEST, "1e300"),
    "TANDEM_ELASTIC_BACKOFF": (lambda: LONGEST / 64, "1e300"),
}
# timeouts go through timeout_seconds, bounded by the same longest wait (test_config.py)
TIMEOUTS = {"TANDEM_TIMEOUT", "TANDEM_CONNECT_TIMEOUT"}
ENV_OF_FIELD = {"local_world_size": "LOCAL_WORLD_SIZE"}


def assert_names(message: str, what: str, value: Any, limit: Any) -> None:
    """The refusal names the setting or argument, its value and the limit, then what to do."""
    for part in (what, f"={value}", f"limit of {limit}", "; "):
        assert part in message, f"{part!r} missing from: {message}"


@pytest.mark.parametrize("name", sorted(SETTING_BOUNDS))
def test_a_setting_past_its_limit_is_refused_naming_setting_value_and_limit(name: str) -> None:
    limit_of, past = SETTING_BOUNDS[name]
    with pytest.raises(ArgumentError) as err:
        load_settings({name: past})
    value = float(past) if "." in past or "e" in past else int(past)
    assert_names(str(err.value), name, value, limit_of())


@pytest.mark.parametrize("name", sorted(n for n in SETTING_BOUNDS if n != "TANDEM_STALL_WARN"
                                        and n != "TANDEM_ELASTIC_BACKOFF"))
def test_a_setting_at_its_limit_is_accepted(name: str) -> None:
    load_settings({name: str(SETTING_BOUNDS[name][0]())})


def test_every_numeric_setting_has_a_bound() -> None:
    numeric = {f.name for f in dataclasses.fields(Settings)
               if f.type in ("int", "float", "int | None")}
    env = {ENV_OF_FIELD.get(n, "TANDEM_" + n.upper()) for n in numeric}
    assert env - TIMEOUTS == set(SETTING_BOUNDS), "a size-like setting without a bound"


@pytest.mark.parametrize("value", [1 << 32, 1 << 34, 1 << 40])
def test_a_shared_memory_chunk_the_host_cannot_hold_is_refused(value: int) -> None:
    # init accepted these, then posix_fallocate ate memory until the ranks were killed
    with pytest.raises(ArgumentError, match=rf"TANDEM_SHM_CHUNK={value} is above its limit"):
        load_settings({"TANDEM_SHM_CHUNK": str(value)})


def test_the_shared_memory_chunk_bound_shrinks_with_the_ranks_on_the_host() -> None:
    one, many = shm_chunk_limit(1), shm_chunk_limit(64)
    assert 2 * 64 * many <= memory_limit() // 4 < 2 * 64 * 2 * many  # a quarter, to a power of 2
    assert one <= memory_limit() // 64 and many < one
    assert shm_chunk_limit(1 << 20) == 4096  # the smallest chunk there is


def test_a_flight_recorder_too_large_for_the_machine_is_refused() -> None:
    # 2**26 calls held ~920 MB per rank, and the first all_reduce never finished
    with pytest.raises(ArgumentError, match=r"TANDEM_FLIGHT_RECORDER=67108864 is above"):
        load_settings({"TANDEM_FLIGHT_RECORDER": str(1 << 26)})


def test_memory_limit_reads_a_cgroup_limit_below_physical_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "_memory", [])
    monkeypatch.setattr(config, "_cgroup_limits", lambda: [1 << 30])
    assert config.memory_limit() == min(1 << 30, os.sysconf("SC_PHYS_PAGES")
                                        * os.sysconf("SC_PAGE_SIZE"))
    assert config.shm_chunk_limit() == 16 << 20  # a 64th of 1 GiB
    monkeypatch.setattr(config, "_memory", [])
    monkeypatch.setattr(config, "_cgroup_limits", lambda: [])
    assert config.memory_limit() >= 1 << 30



@pytest.mark.procs  # a fresh interpreter, which forks
def test_the_memory_limit_is_read_at_import_so_forked_workers_inherit_it() -> None:
    """tandemrun's workers are forked from a process that imported tandem: the cgroup's
    files are read there once, not again by every worker's init (1 ms of its CPU); a
    forked child's settings, read from its own environment, read no cgroup file."""
    code = """if True:
        import builtins, os, sys
        import tandem.config as c
        assert c._memory, "memory limit not known after import"
        opened = []
        real = builtins.open
        def counting(name, *a, **k):
            opened.append(str(name))
            return real(name, *a, **k)
        builtins.open = counting
        os.environ["TANDEM_TIMEOUT"] = "7"
        pid = os.fork()
        if pid == 0:
            s = c.load_settings()
            os._exit(0 if s.timeout == 7 and not opened else 1)
        assert os.waitid(os.P_PID, pid, os.WEXITED).si_status == 0, "child read " + repr(opened)
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


# --- the secret file: type, mode and size before a byte is read -----------------------

def _load_secret_in_child(path: str) -> subprocess.CompletedProcess[str]:
    """load_secret in a child limited to 1 GiB of address space and 20 s: a read that
    blocks or never ends must fail the test, not hang it or fill the machine."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    code = ("import sys\nfrom tandem.config import load_secret\nfrom tandem.errors import "
            "ArgumentError\ntry:\n    load_secret({'TANDEM_SECRET_FILE': sys.argv[1]})\n"
            "except ArgumentError as exc:\n    print(exc)\n")
    return subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                          timeout=20, preexec_fn=limit)


@pytest.mark.procs
def test_a_secret_file_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "secret"
    os.mkfifo(fifo, 0o600)
    try:
        done = _load_secret_in_child(str(fifo))
    except subprocess.TimeoutExpired:
        pytest.fail("load_secret blocked on a FIFO")
    assert "is a FIFO, not a regular file" in done.stdout, done


@pytest.mark.procs
def test_dev_zero_as_secret_file_is_refused_before_it_is_read() -> None:
    done = _load_secret_in_child("/dev/zero")
    assert "is a character device, not a regular file" in done.stdout, done


@pytest.mark.procs
def test_a_huge_secret_file_is_refused_by_its_size(tmp_path: Path) -> None:
    big = tmp_path / "secret"
    with open(big, "wb") as f:
        f.truncate(4 << 30)  # sparse: 4 GiB that take no disk
    big.chmod(0o600)
    done = _load_secret_in_child(str(big))
    assert f"size={4 << 30} is above its limit of {MAX_SECRET_BYTES}" in done.stdout, done


def test_a_world_readable_secret_file_is_refused_before_it_is_opened(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "secret"
    path.write_text("s3cret")
    path.chmod(0o644)
    import builtins

    def opened(*args: object, **kw: object) -> None:
        pytest.fail("opened before the mode check")

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(builtins, "open", opened)
    with pytest.raises(ArgumentError, match="permissions 0644 are too open"):
        load_secret({"TANDEM_SECRET_FILE": str(path)})


def test_a_small_frame_cap_alone_is_accepted() -> None:
    # the chunk and threshold defaults stay valid when only TANDEM_MAX_FRAME is lowered
    assert load_settings({"TANDEM_MAX_FRAME": "4096"}).max_frame == 4096


@pytest.mark.procs  # a fresh interpreter
def test_a_machine_too_small_for_a_default_still_imports_and_init_names_the_setting() -> None:
    """The defaults are checked at import; a memory limit below a default's bound must
    not fail the import: init reports it, naming the setting, as before."""
    code = """if True:
        import builtins
        real = builtins.open
        def tiny(name, *a, **k):
            if str(name).endswith(("memory.max", "memory.limit_in_bytes")):
                import io
                return io.StringIO(str(16 << 20))  # a 16 MiB cgroup
            return real(name, *a, **k)
        builtins.open = tiny
        import tandem.config as c
        builtins.open = real
        assert c._DEFAULTS is None
        try:
            c.load_settings({})
        except c.ArgumentError as exc:
            assert "TANDEM_FLIGHT_RECORDER" in str(exc), exc
        else:
            raise AssertionError("a 16 MiB machine took the default flight recorder")
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("raw", ["-1", "nan", "abc", "-inf"])
@pytest.mark.parametrize("name", sorted(set(SETTING_BOUNDS) | TIMEOUTS))
def test_a_negative_or_non_numeric_value_of_a_numeric_setting_is_refused_naming_it(
        name: str, raw: str) -> None:
    with pytest.raises(ArgumentError) as err:
        load_settings({name: raw})
    assert name in str(err.value) and raw.lstrip("-") in str(err.value).lower(), err.value
