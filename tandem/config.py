"""Every tandem setting in one place.

Settings are read from the environment once, when a process group is created,
into an immutable :class:`Settings`; the object is then passed down explicitly.
Tests build their own with ``Settings(...)`` or ``load_settings(env)``.

=============================  =========================================================
variable                       meaning (default)
=============================  =========================================================
TANDEM_SECRET                  job secret used to authenticate every connection
TANDEM_SECRET_FILE             file holding the job secret (used if TANDEM_SECRET unset)
                               without either, a per-user secret in
                               ``~/.config/tandem/secret`` (mode 0600) is created/used,
                               except in a multi-node srun/mpirun job, which is refused
                               (make one: ``export TANDEM_SECRET=$(python -m tandem.secret)``)
TANDEM_TIMEOUT                 default deadline of collectives and p2p ops, seconds (1800)
TANDEM_CONNECT_TIMEOUT         deadline of set-up, seconds: reaching the store (name
                               resolution included), finding the peers' addresses and
                               connecting to them; the init timeout if shorter (60)
TANDEM_BIND_ADDR               address the transport listens on; default: loopback when
                               MASTER_ADDR is a loopback name, else all interfaces only
                               if set to 0.0.0.0 explicitly (here or as MASTER_ADDR),
                               otherwise the address of the interface that routes to
                               MASTER_ADDR; on 0.0.0.0 peers are told that address
TANDEM_MAX_FRAME               largest accepted message payload in bytes (16 GiB)
TANDEM_ALGORITHM               force one all-reduce algorithm: auto, naive, ring,
                               doubling, shm, hierarchical, or a registered custom
                               one (auto)
TANDEM_RING_THRESHOLD          all-reduce payloads of at least this many bytes use the
                               ring algorithm, smaller ones recursive doubling; two
                               ranks use four times this (524288)
TANDEM_CHUNK_BYTES             smallest pipeline chunk of the ring algorithm; a larger
                               segment is cut into eight chunks (1 MiB)
TANDEM_LINK_CHUNK_BYTES        the same for a group whose ranks are on several hosts,
                               one per host (ring chunks, recursive doubling's pieces),
                               when smaller than TANDEM_CHUNK_BYTES (262144)
TANDEM_SHM_ARENA               0: same-host groups do not share staging memory, so
                               collectives go through the message rings only (1)
TANDEM_SHM_CHUNK               staging bytes per rank and half of a shared-memory arena,
                               a power of two >= 4096; 0 picks 1 MiB, or 4 MiB when
                               the host has fewer CPUs than local ranks (0)
TANDEM_DEBUG                   1: log rejected connections to stderr, and under
                               ``tandemrun`` print every failing rank's whole traceback,
                               tandem's own frames included (0)
TANDEM_RUN_ID                  the job's id, set by ``tandemrun`` for its workers (what
                               ``is_torchelastic_launched`` looks for; unset)
TANDEM_HOST_ID                 this rank's host identity, for topology decisions (default:
                               the host name); set it to simulate hosts on one machine
LOCAL_WORLD_SIZE               ranks per node (set by the launcher); the default
                               ``group_size`` of ``new_subgroups``
TANDEM_STALL_WARN              seconds a collective or p2p call may wait before every
                               waiting rank logs a stall warning naming the ranks that
                               have not arrived and what they are doing; repeated at
                               doubling intervals until the deadline; 0 turns the
                               warnings and their watchdog off (30)
TANDEM_FLIGHT_RECORDER         calls each process group remembers (its flight recorder,
                               dumped on failures and on SIGUSR1); 0 turns recording
                               off, and with it stall warnings, dumps, the timeline's
                               call spans and ``tandem.stats()`` (2000)
TANDEM_TRACE_DIR               where flight-recorder dumps go, one ``rank<N>.json`` per
                               rank; ``tandemrun --log-dir`` sets it under the log dir
                               (``./tandem-trace``)
TANDEM_DUMP_NOTICE             0: a rank does not say on stderr where it wrote its flight
                               recorder; ``tandemrun`` sets 0 for its workers, since it
                               names every rank's dump in one line itself (1)
TANDEM_TIMELINE                write a Chrome/Perfetto trace of this rank's calls to
                               ``<path stem>.rank<N>.json``; ``tandemrun`` or
                               ``python -m tandem.trace --timeline PATH`` merges the
                               ranks' files into PATH (unset: no timeline)
TANDEM_ELASTIC_STORE           where the workers of an elastic job (``tandem.elastic``)
                               agree on membership: ``tcp://HOST:PORT`` or
                               ``file:///PATH``, optionally ``?prefix=NAME``; tandemrun
                               sets it to a store its agent serves (unset: the store of
                               the process group, which must outlive every rank)
TANDEM_ELASTIC_ID              this worker's name in an elastic job, unique per process
                               (set by tandemrun; default: host, pid and a random tag)
TANDEM_ELASTIC_JOIN            1: this worker joins a running elastic job (a replacement
                               or a spare started by tandemrun); it trains alone until
                               ``run_elastic`` admits it (0)
TANDEM_ELASTIC_MAX_RANKS       most ranks an elastic job admits; joiners beyond it wait
                               as spares (tandemrun: MAX nodes x nproc; 0: no limit)
TANDEM_ELASTIC_MIN_NODES       fewest nodes an elastic job goes on with (tandemrun: MIN
                               of --nnodes; 1)
TANDEM_ELASTIC_NODE            this worker's node in an elastic job (tandemrun: the node
                               rank; default: the host identity)
TANDEM_ELASTIC_MASTER_ADDR     a joining worker's MASTER_ADDR once admitted (tandemrun:
                               the job's; its own world before admission is on loopback)
TANDEM_ELASTIC_BACKOFF         tandemrun, elastic jobs: seconds before the second
                               replacement of a worker slot whose workers keep dying,
                               doubling with every further death, at most 64 times (1)
=============================  =========================================================

Flags take ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``; anything else
is refused, so a typo never flips a setting. Timeouts, here and in every function that
takes one, must be finite and positive: :func:`timeout_seconds` checks them.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import secrets
import stat
import threading
from pathlib import Path
from typing import Callable, Mapping, TypeVar

from tandem.errors import ArgumentError

__all__ = ["Settings", "load_settings", "load_secret", "timeout_seconds", "ALGORITHMS"]

ALGORITHMS = ("auto", "naive", "ring", "doubling", "shm", "hierarchical")
N = TypeVar("N", int, float)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    timeout: float = 1800.0
    connect_timeout: float = 60.0
    bind_addr: str | None = None
    max_frame: int = 16 << 30
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
        if not self.algorithm:
            # names are checked against the algorithm registry when a collective runs,
            # so algorithms registered by the user are accepted too
            raise ArgumentError(f"TANDEM_ALGORITHM must name an algorithm, e.g. {ALGORITHMS}")
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
    base = Settings()
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


def _read_secret_file(path: Path, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)  # of the file we read
            data = f.read().strip()
    except OSError as exc:
        raise ArgumentError(f"{what} cannot be read: {exc}") from exc
    if mode & 0o077:
        raise ArgumentError(
            f"{what}: permissions {mode:04o} are too open: other users of this host could "
            f"read the job secret and join the job; make it private with chmod 600 {path} "
            f"(a Kubernetes secret volume: defaultMode 0400)")
    if not data:
        raise ArgumentError(f"{what} is empty")
    return data
