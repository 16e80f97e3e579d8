"""Where a job meets: the ``init_method`` URL, turned into a store, a rank and a world size.

``env://`` reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (filled in from the
scheduler under srun / mpirun, see :mod:`~tandem.collectives.cluster_env`); ``tcp://host:port``
and ``file:///path`` take ``?rank=`` and ``?world_size=`` in the URL or as arguments::

    store, rank, world_size, master = open_store("tcp://10.0.0.1:29500?rank=1&world_size=4",
                                                 -1, -1, timeout=1800, connect_timeout=60)

Every value is checked before anything is allocated or connected: a rank or world size
that is not an integer, out of range, or absurdly large is an ``ArgumentError`` naming it.
Reaching the store waits at most ``connect_timeout``.
"""

from __future__ import annotations

import datetime
import urllib.parse
from typing import Mapping

from tandem.collectives.cluster_env import cluster_env
from tandem.config import MAX_WORLD_SIZE, at_most
from tandem.errors import ArgumentError
from tandem.store.base import Store
from tandem.store.file import FileStore
from tandem.store.tcp import TCPStore

__all__ = ["open_store", "check_rank", "MAX_WORLD_SIZE"]


def _int_text(raw: str, what: str) -> int:
    try:
        return int(raw)
    except ValueError as exc:
        raise ArgumentError(f"{what}={raw!r} is not an integer") from exc


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    return _int_text(raw, f"environment variable {name}")


def check_rank(rank: object, world_size: object) -> None:
    """Refuse a rank or world size that is not an int in range, naming it."""
    for name, value in (("world_size", world_size), ("rank", rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ArgumentError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    assert isinstance(rank, int) and isinstance(world_size, int)
    if world_size < 1:
        raise ArgumentError(f"world_size must be in [1, {MAX_WORLD_SIZE}], got {world_size}")
    at_most("world_size", world_size, MAX_WORLD_SIZE,
            "MAX_WORLD_SIZE, far beyond any job tandem serves", "check the world size given")
    if not 0 <= rank < world_size:
        raise ArgumentError(f"rank must be in [0, {world_size}), got {rank}")


def open_store(init_method: str, rank: int, world_size: int, timeout: float,
               connect_timeout: float, env: Mapping[str, str]) -> tuple[Store, int, int, str | None]:
    """Return (store, rank, world_size, master address) for an ``init_method`` URL.

    ``timeout`` becomes the store's deadline for get/wait; ``connect_timeout`` bounds
    reaching a TCP store (name resolution included).
    """
    if not isinstance(init_method, str):
        raise ArgumentError(f"init_method must be a URL string, got {type(init_method).__name__}")
    url = urllib.parse.urlparse(init_method)
    query = dict(urllib.parse.parse_qsl(url.query))
    if "rank" in query:
        rank = _int_text(query["rank"], f"init_method {init_method!r}: rank")
    if "world_size" in query:
        world_size = _int_text(query["world_size"], f"init_method {init_method!r}: world_size")
    if url.scheme == "env":
        env = cluster_env(env)  # srun / mpirun give ranks through their own variables
        if rank < 0:
            rank = _env_int(env, "RANK", -1)
        if world_size < 0:
            world_size = _env_int(env, "WORLD_SIZE", -1)
        missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not env.get(n)]
        if rank < 0:
            missing.append("RANK")
        if world_size < 0:
            missing.append("WORLD_SIZE")
        if missing:
            raise ArgumentError(
                f"init_method='env://' needs the environment variable(s) {', '.join(missing)} "
                f"(set by tandemrun / torchrun, derived under srun / mpirun, or export them "
                f"yourself)")
        host, port = env["MASTER_ADDR"], _env_int(env, "MASTER_PORT", 0)
    elif url.scheme == "tcp":
        if not url.hostname or not url.port:
            raise ArgumentError(f"init_method {init_method!r} must look like tcp://host:port")
        host, port = url.hostname, url.port
    elif url.scheme == "file":
        if rank < 0 or world_size < 0:  # unset; a size of 0 is named by check_rank
            raise ArgumentError("init_method='file://...' needs rank= and world_size=")
        check_rank(rank, world_size)
        path = url.path if not url.netloc else url.netloc + url.path
        return FileStore(path, world_size, timeout=timeout), rank, world_size, None
    else:
        raise ArgumentError(
            f"init_method {init_method!r}: scheme must be env://, tcp:// or file://")
    if rank < 0 or world_size < 0:  # unset; a size of 0 is named by check_rank
        raise ArgumentError(f"init_method {init_method!r} needs rank= and world_size=")
    check_rank(rank, world_size)
    store = TCPStore(host, port, world_size, is_master=(rank == 0),
                     timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False,
                     connect_timeout=connect_timeout)
    return store, rank, world_size, host
