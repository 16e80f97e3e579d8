"""Every tandem setting in one place.

Settings are read from the environment once, when a process group is created,
into an immutable :class:`Settings`; the object is then passed down explicitly.
Tests build their own with ``Settings(...)`` or ``load_settings(env)``. The table of
every variable, its meaning and its default is ``docs/settings.md`` (``tests/test_config.py``
checks it lists each one read here). Flags take ``1``/``true``/``yes``/``on`` or
``0``/``false``/``no``/``off``; anything else is refused. Timeouts must be finite and
positive: :func:`timeout_seconds` checks them.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import operator
import os
import secrets
import stat
import threading
from pathlib import Path
from typing import Callable, Mapping, TypeVar

from tandem.errors import ArgumentError

__all__ = ["Settings", "load_settings", "load_secret", "timeout_seconds", "ALGORITHMS",
           "MAX_WORLD_SIZE", "MAX_SECRET_BYTES", "memory_limit", "memory_text", "at_most", "size_text",
           "shm_chunk_limit", "flight_recorder_limit", "max_frame_limit", "flag_argument",
           "int_argument", "number_argument"]

ALGORITHMS = ("auto", "naive", "ring", "doubling", "shm", "hierarchical")
N = TypeVar("N", int, float)

# Far beyond any job tandem serves (every rank keeps a link to every other); larger counts
# of ranks are mistakes, and refusing them up front spares allocating per-rank tables.
MAX_WORLD_SIZE = 1 << 20
# A secret is a few dozen bytes; a Kubernetes secret volume's file is far below this.
MAX_SECRET_BYTES = 64 << 10
DEFAULT_MAX_FRAME = 16 << 30
# What a full flight-recorder ring may cost per call and group (a record list of nine
# fields with its floats, and a point-to-point Call): an upper estimate.
RECORD_BYTES = 512


def _cgroup_limits() -> list[int]:
    """Memory limits of this process's cgroup and its ancestors (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``); "max" and v1's near-2**63 "unlimited" are left out."""
    limits = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            root, name = "/sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            root, name = "/sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        # a cgroup namespace shows "/" while the mount shows our own cgroup at its root
        for depth in range(len(parts), -1, -1):
            try:
                with open(os.path.join(root, *parts[:depth], name)) as f:
                    raw = f.read().strip()
            except OSError:
                continue
            if raw.isdigit() and int(raw) < (1 << 62):
                limits.append(int(raw))
    return limits


_memory: list[int] = []


def memory_limit() -> int:
    """Bytes of memory this machine gives this process: its physical memory or, when
    lower, what its memory cgroup (or an ancestor) allows. Read once per process."""
    if not _memory:
        try:
            physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            physical = 1 << 40  # unknown: the fixed caps still hold
        _memory.append(min([physical, *_cgroup_limits()]))
    return _memory[0]


def memory_text() -> str:
    """The memory bounds are drawn from, for messages: ``23.5 GiB of memory here (...)``."""
    return (f"{size_text(memory_limit())} of memory here (physical memory, or the memory "
            f"cgroup's limit when lower)")


def size_text(nbytes: float) -> str:
    """``268435456`` -> ``256 MiB``: a byte count for people."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.3g} {unit}"
    return f"{nbytes:.0f} bytes"


def at_most(what: str, value: N, limit: N, why: str, fix: str) -> N:
    """Return ``value`` if it is at most ``limit``, else refuse it naming ``what`` (the
    setting or argument), the value, the limit, ``why`` that limit and ``fix`` (what to do).

    The one check every size, count and duration in tandem goes through before anything
    is allocated for it: a huge value must fail here, not in the kernel's OOM killer.
    """
    if value > limit:
        raise ArgumentError(f"{what}={value} is above its limit of {limit} ({why}); {fix}")
    return value


def flag_argument(what: str, value: object) -> bool:
    """Return ``value`` if it is True or False, else refuse it naming ``what``: a truthy
    word such as ``"no"`` (or a 1, or None) must not switch a feature on or off."""
    if value is not True and value is not False:
        raise ArgumentError(f"{what} must be True or False, got {type(value).__name__} "
                            f"{value!r}")
    return value


def int_argument(what: str, value: object, least: int) -> int:
    """Return ``value`` as an int if it is a whole number (numpy's too, not a bool or a
    float) of at least ``least``, else refuse it naming ``what``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ArgumentError(f"{what} must be an int >= {least}, got {value!r}") from None
    if number < least:
        raise ArgumentError(f"{what} must be an int >= {least}, got {number}")
    return number


def number_argument(what: str, value: object, least: float) -> float:
    """Return ``value`` as a float if it is a finite real number of at least ``least``,
    else refuse it naming ``what`` (NaN too: every comparison with it is false)."""
    if isinstance(value, (bool, str)) or not isinstance(value, (int, float)) and not (
            hasattr(value, "__float__") and hasattr(value, "dtype")):
        raise ArgumentError(f"{what} must be a number >= {least}, got {value!r}")
    number = float(value)
    if not least <= number < math.inf:
        raise ArgumentError(f"{what} must be a finite number >= {least}, got {number}")
    return number


def shm_chunk_limit(local_ranks: int = 1) -> int:
    """Largest ``TANDEM_SHM_CHUNK`` with ``local_ranks`` ranks on this host: the largest
    power of two within a 64th of memory, and within a quarter of it for every local
    rank's two staging halves together."""
    room = min(memory_limit() // 64, memory_limit() // (8 * max(1, local_ranks)))
    return 1 << max(12, room.bit_length() - 1)


def flight_recorder_limit() -> int:
    """Largest ``TANDEM_FLIGHT_RECORDER``: a full ring per group within a 64th of memory."""
    return max(1, memory_limit() // (64 * RECORD_BYTES))


def max_frame_limit() -> int:
    """Largest ``TANDEM_MAX_FRAME``: the machine's memory (the default, if larger)."""
    return max(DEFAULT_MAX_FRAME, memory_limit())


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    timeout: float = 1800.0
    connect_timeout: float = 60.0
    bind_addr: str | None = None
    max_frame: int = DEFAULT_MAX_FRAME
    algorithm: str = "auto"
    ring_threshold: int = 512 << 10
    chunk_bytes: int = 1 << 20
    link_chunk_bytes: int = 256 << 10
    shm_arena: bool = True
    shm_chunk: int = 0
    debug: bool = False
    host_id: str | None = None
    run_id: str | None = None
    local_world_size: int | None = None
    stall_warn: float = 30.0
    check_call_sites: bool = False
    flight_recorder: int = 2000
    trace_dir: str = "tandem-trace"
    dump_notice: bool = True
    timeline: str | None = None
    elastic_store: str | None = None
    elastic_id: str | None = None
    elastic_join: bool = False
    elastic_max_ranks: int = 0
    elastic_min_nodes: int = 1
    elastic_node: str | None = None
    elastic_master_addr: str | None = None
    elastic_backoff: float = 1.0

    def __post_init__(self) -> None:
        timeout_seconds(self.timeout, 0.0, "TANDEM_TIMEOUT")
        timeout_seconds(self.connect_timeout, 0.0, "TANDEM_CONNECT_TIMEOUT")
        if self.local_world_size is not None and self.local_world_size < 1:
            raise ArgumentError(
                f"LOCAL_WORLD_SIZE must be a positive integer, got {self.local_world_size}")
        self._check_bounds()
        if not self.algorithm:
            # names are checked against the algorithm registry when a collective runs,
            # so algorithms registered by the user are accepted too
            raise ArgumentError(f"TANDEM_ALGORITHM must name an algorithm, e.g. {ALGORITHMS}")
        if self.ring_threshold < 0:
            raise ArgumentError(f"TANDEM_RING_THRESHOLD must be >= 0 bytes (0: the ring at "
                                f"every size), got {self.ring_threshold}")
        if self.chunk_bytes < 4096:
            raise ArgumentError(f"TANDEM_CHUNK_BYTES must be >= 4096, got {self.chunk_bytes}")
        if self.link_chunk_bytes < 4096:
            raise ArgumentError(
                f"TANDEM_LINK_CHUNK_BYTES must be >= 4096, got {self.link_chunk_bytes}")
        if self.shm_chunk and (self.shm_chunk < 4096 or self.shm_chunk & (self.shm_chunk - 1)):
            raise ArgumentError(
                f"TANDEM_SHM_CHUNK must be 0 or a power of two >= 4096, got {self.shm_chunk}")
        if self.max_frame < 1024:
            raise ArgumentError(f"TANDEM_MAX_FRAME must be >= 1024, got {self.max_frame}")
        if not self.stall_warn >= 0:
            raise ArgumentError(
                f"TANDEM_STALL_WARN must be >= 0 seconds (0: off), got {self.stall_warn}")
        if self.flight_recorder < 0:
            raise ArgumentError(
                f"TANDEM_FLIGHT_RECORDER must be >= 0 calls (0: off), got {self.flight_recorder}")
        if not self.trace_dir:
            raise ArgumentError("TANDEM_TRACE_DIR must name a directory")
        if self.elastic_max_ranks < 0:
            raise ArgumentError(f"TANDEM_ELASTIC_MAX_RANKS must be >= 0 (0: no limit), got "
                                f"{self.elastic_max_ranks}")
        if self.elastic_min_nodes < 1:
            raise ArgumentError(f"TANDEM_ELASTIC_MIN_NODES must be >= 1, got "
                                f"{self.elastic_min_nodes}")
        if not (math.isfinite(self.elastic_backoff) and self.elastic_backoff >= 0):
            raise ArgumentError(f"TANDEM_ELASTIC_BACKOFF must be a finite number of seconds "
                                f">= 0, got {self.elastic_backoff}")
        if self.elastic_store is not None and not self.elastic_store.startswith(
                ("tcp://", "file://")):
            raise ArgumentError(f"TANDEM_ELASTIC_STORE={self.elastic_store!r}: expected "
                                f"tcp://HOST:PORT or file:///PATH")

    def _check_bounds(self) -> None:
        """Every size, count and duration against its upper bound (see the module doc)."""
        memory = f"there are {memory_text()}"
        ranks = "MAX_WORLD_SIZE, far beyond any job tandem serves"
        if self.local_world_size is not None:
            at_most("LOCAL_WORLD_SIZE", self.local_world_size, MAX_WORLD_SIZE, ranks,
                    "set it to the number of ranks on this node")
        limit = max_frame_limit()
        at_most("TANDEM_MAX_FRAME", self.max_frame, limit,
                f"{size_text(limit)}: no message larger than memory can be received; {memory}",
                "unset it (16 GiB) or lower it")
        for name, value in (("TANDEM_RING_THRESHOLD", self.ring_threshold),
                            ("TANDEM_CHUNK_BYTES", self.chunk_bytes),
                            ("TANDEM_LINK_CHUNK_BYTES", self.link_chunk_bytes)):
            # sizes of messages, not allocations: past the largest frame they mean nothing
            at_most(name, value, limit, f"{size_text(limit)}, the largest TANDEM_MAX_FRAME "
                    f"allowed here", "unset it or lower it")
        limit = shm_chunk_limit()
        at_most("TANDEM_SHM_CHUNK", self.shm_chunk, limit,
                f"{size_text(limit)}, a 64th of memory: every local rank reserves two "
                f"chunks per group in shared memory; {memory}",
                f"unset it (0 picks 1-4 MiB) or choose a power of two up to {limit}")
        limit = flight_recorder_limit()
        at_most("TANDEM_FLIGHT_RECORDER", self.flight_recorder, limit,
                f"a full ring costs up to {RECORD_BYTES} bytes a call in every process "
                f"group, and one ring may take a 64th of memory; {memory}",
                "unset it (2000 calls) or lower it")
        at_most("TANDEM_STALL_WARN", self.stall_warn, _LONGEST,
                "the longest wait this platform allows, in seconds",
                "unset it (30) or use 0 to turn stall warnings off")
        at_most("TANDEM_ELASTIC_BACKOFF", self.elastic_backoff, _LONGEST / 64,
                "the backoff doubles up to 64 times and must stay a wait this platform "
                "allows, in seconds", "unset it (1) or lower it")
        for name, value in (("TANDEM_ELASTIC_MAX_RANKS", self.elastic_max_ranks),
                            ("TANDEM_ELASTIC_MIN_NODES", self.elastic_min_nodes)):
            at_most(name, value, MAX_WORLD_SIZE, ranks, "unset it or lower it")


def _number(env: Mapping[str, str], name: str, kind: Callable[[str], N], default: N) -> N:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError as exc:
        label = getattr(kind, "__name__", "number")
        raise ArgumentError(f"{name}={raw!r} is not a valid {label}") from exc


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ArgumentError(f"{name}={raw!r} is not a flag: use 1/true/yes/on or 0/false/no/off")


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read every ``TANDEM_*`` setting from ``env`` (default: ``os.environ``)."""
    env = os.environ if env is None else env
    base = _DEFAULTS or Settings()
    return Settings(
        timeout=_number(env, "TANDEM_TIMEOUT", float, base.timeout),
        connect_timeout=_number(env, "TANDEM_CONNECT_TIMEOUT", float, base.connect_timeout),
        bind_addr=env.get("TANDEM_BIND_ADDR") or None,
        max_frame=_number(env, "TANDEM_MAX_FRAME", int, base.max_frame),
        algorithm=env.get("TANDEM_ALGORITHM", base.algorithm) or base.algorithm,
        ring_threshold=_number(env, "TANDEM_RING_THRESHOLD", int, base.ring_threshold),
        chunk_bytes=_number(env, "TANDEM_CHUNK_BYTES", int, base.chunk_bytes),
        link_chunk_bytes=_number(env, "TANDEM_LINK_CHUNK_BYTES", int, base.link_chunk_bytes),
        shm_arena=_flag(env, "TANDEM_SHM_ARENA", base.shm_arena),
        shm_chunk=_number(env, "TANDEM_SHM_CHUNK", int, base.shm_chunk),
        debug=_flag(env, "TANDEM_DEBUG", base.debug),
        host_id=env.get("TANDEM_HOST_ID") or None,
        run_id=env.get("TANDEM_RUN_ID") or None,
        local_world_size=(_number(env, "LOCAL_WORLD_SIZE", int, 0)
                          if env.get("LOCAL_WORLD_SIZE") else None),
        stall_warn=_number(env, "TANDEM_STALL_WARN", float, base.stall_warn),
        check_call_sites=_flag(env, "TANDEM_CHECK_CALL_SITES", base.check_call_sites),
        flight_recorder=_number(env, "TANDEM_FLIGHT_RECORDER", int, base.flight_recorder),
        trace_dir=env.get("TANDEM_TRACE_DIR") or base.trace_dir,
        dump_notice=_flag(env, "TANDEM_DUMP_NOTICE", base.dump_notice),
        timeline=env.get("TANDEM_TIMELINE") or None,
        elastic_store=env.get("TANDEM_ELASTIC_STORE") or None,
        elastic_id=env.get("TANDEM_ELASTIC_ID") or None,
        elastic_join=_flag(env, "TANDEM_ELASTIC_JOIN", base.elastic_join),
        elastic_max_ranks=_number(env, "TANDEM_ELASTIC_MAX_RANKS", int, base.elastic_max_ranks),
        elastic_min_nodes=_number(env, "TANDEM_ELASTIC_MIN_NODES", int, base.elastic_min_nodes),
        elastic_node=env.get("TANDEM_ELASTIC_NODE") or None,
        elastic_master_addr=env.get("TANDEM_ELASTIC_MASTER_ADDR") or None,
        elastic_backoff=_number(env, "TANDEM_ELASTIC_BACKOFF", float, base.elastic_backoff),
    )


# the longest wait the platform's locks accept (longer ones raise OverflowError mid-call)
_LONGEST = threading.TIMEOUT_MAX


def timeout_seconds(timeout: float | datetime.timedelta | None, default: float,
                    what: str = "timeout") -> float:
    """``timeout`` (seconds or a ``timedelta``; ``None``: ``default``) as finite seconds.

    NaN, infinite, zero and negative values are refused: a NaN deadline never passes
    and one in the past has passed already, so neither bounds a wait. ``what`` names
    the argument in the message (``"barrier: timeout"``).
    """
    if timeout is None:
        return default
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ArgumentError(f"{what} must be seconds (a number) or a datetime.timedelta, "
                            f"got {type(timeout).__name__}")
    if not math.isfinite(seconds) or seconds <= 0 or seconds > _LONGEST:
        raise ArgumentError(f"{what} must be a finite, positive number of seconds at most "
                            f"{_LONGEST:.0f}, got {timeout!r}; every wait in tandem has a "
                            f"deadline")
    return seconds


def _user_secret_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "tandem" / "secret"


def secret_configured(env: Mapping[str, str] | None = None) -> bool:
    """Whether the job secret was given (``TANDEM_SECRET`` or ``TANDEM_SECRET_FILE``),
    rather than left to the per-user file."""
    env = os.environ if env is None else env
    return bool(env.get("TANDEM_SECRET") or env.get("TANDEM_SECRET_FILE"))


def load_secret(env: Mapping[str, str] | None = None) -> bytes:
    """Return the job secret that authenticates every connection.

    Order: ``TANDEM_SECRET``, then the file named by ``TANDEM_SECRET_FILE``, then a
    per-user secret file (created with mode 0600 on first use). The per-user file
    makes single-host jobs and clusters with a shared home directory work without
    set-up while keeping other users of the machine out. A secret file that other
    users may read or write is refused, as ssh refuses such a private key.
    """
    env = os.environ if env is None else env
    value = env.get("TANDEM_SECRET")
    if value:
        return value.encode()
    path_name = env.get("TANDEM_SECRET_FILE")
    if path_name:
        return _read_secret_file(Path(path_name), f"TANDEM_SECRET_FILE={path_name!r}")
    spread = _multi_node_job(env)
    if spread:
        raise ArgumentError(
            f"{spread}: a multi-node job needs one secret shared by every node; make one "
            f"before starting it, e.g. in the batch script: "
            f"export TANDEM_SECRET=$(python -m tandem.secret) (or point TANDEM_SECRET_FILE "
            f"at a private file every node reads)")
    path = _user_secret_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".secret.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)  # atomic: the first writer wins, others read its secret
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    return _read_secret_file(path, f"the per-user secret file {str(path)!r}")


def _multi_node_job(env: Mapping[str, str]) -> str:
    """What says this process belongs to a job spanning several nodes (empty if nothing)."""
    nodes = env.get("SLURM_STEP_NUM_NODES", "")  # set in srun's tasks, not in a batch shell
    if nodes.isdigit() and int(nodes) > 1:
        return f"this SLURM job step spans {nodes} nodes (SLURM_STEP_NUM_NODES)"
    size, local = env.get("OMPI_COMM_WORLD_SIZE", ""), env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
    if size.isdigit() and local.isdigit() and int(local) < int(size):
        return (f"this mpirun job has {local} of its {size} ranks on this host "
                f"(OMPI_COMM_WORLD_LOCAL_SIZE)")
    return ""


_FILE_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISDIR, "a directory"))


def _check_secret_stat(st: os.stat_result, path: Path, what: str) -> None:
    """Refuse a secret file by what ``os.stat`` says, before a byte of it is read: a FIFO
    would block the read forever, a device (``/dev/zero``) or a huge file fill memory."""
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _FILE_KINDS if test(st.st_mode)), "not a regular file")
        raise ArgumentError(f"{what} is {kind}, not a regular file: a FIFO would block and a "
                            f"device never end; put the secret in a file of at most "
                            f"{MAX_SECRET_BYTES} bytes")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ArgumentError(
            f"{what}: permissions {mode:04o} are too open: other users of this host could "
            f"read the job secret and join the job; make it private with chmod 600 {path} "
            f"(a Kubernetes secret volume: defaultMode 0400)")
    at_most(f"{what}: size", st.st_size, MAX_SECRET_BYTES,
            "bytes: a job secret is a few dozen bytes",
            "point it at a file holding only the secret")


def _read_secret_file(path: Path, what: str) -> bytes:
    try:
        # type, mode and size come first, from stat, so nothing is opened that could block
        _check_secret_stat(os.stat(path), path, what)
        # O_NONBLOCK: a FIFO swapped in after the stat must not block the open either
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ArgumentError(f"{what} cannot be read: {exc}") from exc
    try:
        _check_secret_stat(os.fstat(fd), path, what)  # of the file we read
        raw = os.read(fd, MAX_SECRET_BYTES + 1)  # one more byte tells a file that grew
    except OSError as exc:
        raise ArgumentError(f"{what} cannot be read: {exc}") from exc
    finally:
        os.close(fd)
    at_most(f"{what}: size", len(raw), MAX_SECRET_BYTES, "bytes: a job secret is a few "
            "dozen bytes", "point it at a file holding only the secret")
    data = raw.strip()
    if not data:
        raise ArgumentError(f"{what} is empty")
    return data


def _checked_defaults() -> Settings | None:
    try:
        return Settings()
    except ArgumentError:  # a machine too small for a default: load_settings says so
        return None


# the defaults, checked once at import: a forked worker (tandemrun's zygote) inherits them
# and the memory limit they were checked against (the cgroup's files read in the zygote)
_DEFAULTS = _checked_defaults()
