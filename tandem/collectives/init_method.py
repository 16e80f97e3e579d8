"""Where a job meets: the ``init_method`` URL, turned into a store, a rank and a world size.

``env://`` reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (filled in from the
scheduler under srun / mpirun, see :mod:`~tandem.collectives.cluster_env`); ``tcp://host:port``
and ``file:///path`` take ``?rank=`` and ``?world_size=`` in the URL or as arguments::

    store, rank, world_size, master = open_store("tcp://10.0.0.1:29500?rank=1&world_size=4",
                                                 -1, -1, timeout=1800, connect_timeout=60)

Every value is checked before anything is allocated or connected: a rank, world size or
port that is not an integer, out of range, or absurdly large is an ``ArgumentError`` naming
it, and one read from the environment names the variable, its value and what it must be
(:func:`env_int`). Reaching the store waits at most ``connect_timeout``.
"""

from __future__ import annotations

import datetime
import urllib.parse
from typing import Mapping

from tandem.collectives.cluster_env import cluster_env, env_int, text_int
from tandem.config import MAX_WORLD_SIZE, at_most
from tandem.errors import ArgumentError
from tandem.store.base import Store
from tandem.store.file import FileStore
from tandem.store.tcp import TCPStore

__all__ = ["open_store", "check_rank", "env_int", "check_env", "MAX_WORLD_SIZE"]

_PORTS = "a TCP port, 1..65535"


def _url_int(init_method: str, query: Mapping[str, list[str]], key: str, low: int,
             expected: str, given: int) -> int:
    """``?key=`` of the URL, an integer in ``[low, MAX_WORLD_SIZE]``; else an
    ``ArgumentError`` naming the URL's parameter (a wrong one is never read as unset)."""
    if key not in query:
        return given
    raws = query[key]
    if len(raws) != 1:
        raise ArgumentError(f"init_method {init_method!r} gives {key}= {len(raws)} times: "
                            f"give it once, {expected}")
    return text_int(raws[0], low, MAX_WORLD_SIZE, f"init_method {init_method!r}: {key}",
                    expected)


def check_env(env: Mapping[str, str], rank: int = -1,
              world_size: int = -1) -> tuple[int, int, int]:
    """RANK, WORLD_SIZE and MASTER_PORT of ``env`` (a ``rank`` or ``world_size`` argument
    of 0 or more wins over its variable), and LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK
    and GROUP_WORLD_SIZE if set, each checked and named when wrong.
    Returns (rank, world size, port)."""
    if world_size < 0:
        world_size = env_int(env, "WORLD_SIZE", 1, MAX_WORLD_SIZE,
                             f"the number of ranks, 1..{MAX_WORLD_SIZE}")
    else:
        check_rank(0, world_size)
    if rank < 0:
        rank = env_int(env, "RANK", 0, world_size - 1,
                       f"this process's rank, 0..WORLD_SIZE-1 = {world_size - 1}")
    check_rank(rank, world_size)
    if rank == 0:  # the store's host may take any free port (tandemrun's standby ranks)
        port = env_int(env, "MASTER_PORT", 0, 65535,
                       f"{_PORTS}, where rank 0 serves the store (0 on rank 0: any free port)")
    else:
        port = env_int(env, "MASTER_PORT", 1, 65535, f"{_PORTS}, where rank 0 serves the store")
    # only each alone: an in-place spare has LOCAL_RANK >= LOCAL_WORLD_SIZE and WORLD_SIZE=1
    for name, low, expected in (("LOCAL_WORLD_SIZE", 1, "the ranks on this node"),
                                ("LOCAL_RANK", 0, "this rank's index on its node"),
                                ("GROUP_WORLD_SIZE", 1, "the number of nodes"),
                                ("GROUP_RANK", 0, "this node's rank")):
        env_int(env, name, low, MAX_WORLD_SIZE, f"{expected}, {low}..{MAX_WORLD_SIZE}", 0)
    return rank, world_size, port


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
    for name, value, low in (("rank", rank, 0), ("world_size", world_size, 1)):
        # -1 is the default, "take it from the URL or the environment"; -5 was read as it
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ArgumentError(f"{name}={value!r}: expected an int, {low} or more, or -1 (the "
                                f"default: take it from the init_method URL or the environment)")
    url = urllib.parse.urlparse(init_method)
    query = urllib.parse.parse_qs(url.query, keep_blank_values=True)  # "?rank=" is named too
    rank = _url_int(init_method, query, "rank", 0,
                    "this process's rank, 0..world_size-1", rank)
    world_size = _url_int(init_method, query, "world_size", 1,
                          f"the number of ranks, 1..{MAX_WORLD_SIZE}", world_size)
    if url.scheme == "env":
        env = cluster_env(env)  # srun / mpirun give ranks through their own variables
        missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if n not in env]
        missing += [n for n, given in (("RANK", rank), ("WORLD_SIZE", world_size))
                    if given < 0 and n not in env]
        if missing:
            raise ArgumentError(
                f"init_method='env://' needs the environment variable(s) {', '.join(missing)} "
                f"(set by tandemrun / torchrun, derived under srun / mpirun, or export them "
                f"yourself)")
        if not env["MASTER_ADDR"].strip():
            raise ArgumentError(f"environment variable MASTER_ADDR={env['MASTER_ADDR']!r} is "
                                f"empty: expected the host name or address of rank 0, where "
                                f"the store is served")
        rank, world_size, port = check_env(env, rank, world_size)
        host = env["MASTER_ADDR"]
    elif url.scheme == "tcp":
        try:
            url_port = url.port
        except ValueError as exc:  # urllib: "Port out of range 0-65535" or not a number
            raise ArgumentError(f"init_method {init_method!r}: the port must be an integer, "
                                f"1..65535 ({exc})") from exc
        if not url.hostname or not url_port:
            raise ArgumentError(f"init_method {init_method!r} must look like tcp://host:port "
                                f"(port 1..65535)")
        host, port = url.hostname, url_port
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
