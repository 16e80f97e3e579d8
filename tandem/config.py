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
                               ``~/.config/tandem/secret`` (mode 0600) is created/used
TANDEM_TIMEOUT                 default deadline of collectives and p2p ops, seconds (1800)
TANDEM_CONNECT_TIMEOUT         deadline to connect to peers and store, seconds (60)
TANDEM_BIND_ADDR               address the transport listens on; default: loopback when
                               MASTER_ADDR is a loopback name, else all interfaces only
                               if set to 0.0.0.0 explicitly, otherwise the address of the
                               interface that routes to MASTER_ADDR
TANDEM_MAX_FRAME               largest accepted message payload in bytes (16 GiB)
TANDEM_ALGORITHM               force one all-reduce algorithm: auto, naive, ring,
                               doubling, shm, hierarchical, or a registered custom
                               one (auto)
TANDEM_RING_THRESHOLD          all-reduce payloads of at least this many bytes use the
                               ring algorithm, smaller ones recursive doubling; two
                               ranks use four times this (524288)
TANDEM_CHUNK_BYTES             smallest pipeline chunk of the ring algorithm; a larger
                               segment is cut into eight chunks (1 MiB)
TANDEM_SHM_ARENA               0: same-host groups do not share staging memory, so
                               collectives go through the message rings only (1)
TANDEM_SHM_CHUNK               staging bytes per rank and half of a shared-memory arena,
                               a power of two >= 4096; 0 picks 1 MiB, or 4 MiB when
                               the host has fewer CPUs than local ranks (0)
TANDEM_DEBUG                   1: log connection set-up and aborts to stderr (0)
=============================  =========================================================
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from pathlib import Path
from typing import Callable, Mapping, TypeVar

from tandem.errors import ArgumentError

__all__ = ["Settings", "load_settings", "load_secret", "ALGORITHMS"]

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
    shm_arena: bool = True
    shm_chunk: int = 0
    debug: bool = False

    def __post_init__(self) -> None:
        if self.timeout <= 0:
            raise ArgumentError(f"TANDEM_TIMEOUT must be positive seconds, got {self.timeout}")
        if self.connect_timeout <= 0:
            raise ArgumentError(
                f"TANDEM_CONNECT_TIMEOUT must be positive seconds, got {self.connect_timeout}"
            )
        if not self.algorithm:
            # names are checked against the algorithm registry when a collective runs,
            # so algorithms registered by the user are accepted too
            raise ArgumentError(f"TANDEM_ALGORITHM must name an algorithm, e.g. {ALGORITHMS}")
        if self.chunk_bytes < 4096:
            raise ArgumentError(f"TANDEM_CHUNK_BYTES must be >= 4096, got {self.chunk_bytes}")
        if self.shm_chunk and (self.shm_chunk < 4096 or self.shm_chunk & (self.shm_chunk - 1)):
            raise ArgumentError(
                f"TANDEM_SHM_CHUNK must be 0 or a power of two >= 4096, got {self.shm_chunk}")
        if self.max_frame < 1024:
            raise ArgumentError(f"TANDEM_MAX_FRAME must be >= 1024, got {self.max_frame}")


def _number(env: Mapping[str, str], name: str, kind: Callable[[str], N], default: N) -> N:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError as exc:
        label = getattr(kind, "__name__", "number")
        raise ArgumentError(f"{name}={raw!r} is not a valid {label}") from exc


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    return raw not in ("0", "false", "False", "no")


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
        shm_arena=_flag(env, "TANDEM_SHM_ARENA", base.shm_arena),
        shm_chunk=_number(env, "TANDEM_SHM_CHUNK", int, base.shm_chunk),
        debug=_flag(env, "TANDEM_DEBUG", base.debug),
    )


def _user_secret_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "tandem" / "secret"


def load_secret(env: Mapping[str, str] | None = None) -> bytes:
    """Return the job secret that authenticates every connection.

    Order: ``TANDEM_SECRET``, then the file named by ``TANDEM_SECRET_FILE``, then a
    per-user secret file (created with mode 0600 on first use). The per-user file
    makes single-host jobs and clusters with a shared home directory work without
    set-up while keeping other users of the machine out.
    """
    env = os.environ if env is None else env
    value = env.get("TANDEM_SECRET")
    if value:
        return value.encode()
    path_name = env.get("TANDEM_SECRET_FILE")
    if path_name:
        try:
            data = Path(path_name).read_bytes().strip()
        except OSError as exc:
            raise ArgumentError(f"TANDEM_SECRET_FILE={path_name!r} cannot be read: {exc}") from exc
        if not data:
            raise ArgumentError(f"TANDEM_SECRET_FILE={path_name!r} is empty")
        return data
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
    return path.read_bytes().strip()
