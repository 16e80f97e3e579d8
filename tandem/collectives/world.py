"""Initialisation and the default-group registry that torch's API requires.

``init_process_group`` finds the store (``env://``, ``tcp://``, ``file://`` or a
given ``store``), connects the transport and creates the default group. The
``_world`` registry below is the one piece of module-level state in tandem: the
torch-compatible functions (``all_reduce(t)`` without a group) need it.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import urllib.parse
from typing import Mapping

from tandem import _wire
from tandem.collectives.backend import Backend, BackendOptions, resolve_backend
from tandem.collectives.cluster_env import cluster_env
from tandem.collectives.group import NonMemberGroup, ProcessGroup, timeout_seconds
from tandem.collectives.monitor import Monitor
from tandem.config import Settings, load_secret, load_settings
from tandem.errors import ArgumentError, StateError
from tandem.store.base import Store
from tandem.store.file import FileStore
from tandem.store.prefix import PrefixStore
from tandem.store.tcp import TCPStore
from tandem.transport.base import Transport

__all__ = [
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "is_available",
    "get_rank",
    "get_world_size",
    "get_backend",
    "default_group",
    "resolve_group",
    "World",
]

AnyGroup = ProcessGroup | NonMemberGroup


@dataclasses.dataclass
class World:
    default: ProcessGroup
    store: Store
    transport: Transport
    settings: Settings
    backend: str
    generation: int
    owns_store: bool
    groups: list[AnyGroup] = dataclasses.field(default_factory=list)
    groups_made: int = 0
    monitor: Monitor | None = None  # watchdog, flight-recorder dumps, timeline

    def process_groups(self) -> list[ProcessGroup]:
        """The groups this rank is a member of, the default group first."""
        return [self.default] + [g for g in self.groups if isinstance(g, ProcessGroup)]


_world: World | None = None


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError as exc:
        raise ArgumentError(f"environment variable {name}={raw!r} is not an integer") from exc


def _rendezvous(init_method: str, rank: int, world_size: int, timeout: float,
                env: Mapping[str, str]) -> tuple[Store, int, int, str | None]:
    """Return (store, rank, world_size, master address) for an init_method URL."""
    url = urllib.parse.urlparse(init_method)
    query = dict(urllib.parse.parse_qsl(url.query))
    if "rank" in query:
        rank = int(query["rank"])
    if "world_size" in query:
        world_size = int(query["world_size"])
    if url.scheme == "env":
        env = cluster_env(env)  # srun / mpirun give ranks through their own variables
        if rank < 0:
            rank = _env_int(env, "RANK") if _env_int(env, "RANK") is not None else -1  # type: ignore[assignment]
        if world_size < 0:
            world_size = _env_int(env, "WORLD_SIZE") if _env_int(env, "WORLD_SIZE") is not None else -1  # type: ignore[assignment]
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
        host, port = env["MASTER_ADDR"], _env_int(env, "MASTER_PORT")
    elif url.scheme == "tcp":
        if not url.hostname or not url.port:
            raise ArgumentError(f"init_method {init_method!r} must look like tcp://host:port")
        host, port = url.hostname, url.port
    elif url.scheme == "file":
        if rank < 0 or world_size <= 0:
            raise ArgumentError("init_method='file://...' needs rank= and world_size=")
        path = url.path if not url.netloc else url.netloc + url.path
        return FileStore(path, world_size, timeout=timeout), rank, world_size, None
    else:
        raise ArgumentError(
            f"init_method {init_method!r}: scheme must be env://, tcp:// or file://")
    if rank < 0 or world_size <= 0:
        raise ArgumentError(f"init_method {init_method!r} needs rank= and world_size=")
    _check_rank(rank, world_size)
    store = TCPStore(host, port or 0, world_size, is_master=(rank == 0),
                     timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    return store, rank, world_size, host


def _check_rank(rank: int, world_size: int) -> None:
    if world_size <= 0:
        raise ArgumentError(f"world_size must be positive, got {world_size}")
    if not 0 <= rank < world_size:
        raise ArgumentError(f"rank must be in [0, {world_size}), got {rank}")


def bind_address(settings: Settings, master_addr: str | None) -> str:
    """Where this rank's transport listens: loopback for single-host jobs."""
    if settings.bind_addr:
        return settings.bind_addr
    if master_addr is None or _wire.is_loopback(master_addr):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((master_addr, 9))  # UDP connect sends nothing; it picks the route
        return str(probe.getsockname()[0])
    except OSError as exc:
        raise ArgumentError(
            f"cannot find the local address that reaches MASTER_ADDR={master_addr}: {exc}; "
            f"set TANDEM_BIND_ADDR") from exc
    finally:
        probe.close()


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Store | None = None,
    group_name: str = "",
    pg_options: object = None,
    device_id: object = None,
) -> None:
    """Join the job: connect to every other rank and create the default group."""
    global _world
    if _world is not None:
        raise StateError("tandem is already initialised; call destroy_process_group() first")
    settings = load_settings()
    backend_name = resolve_backend(backend)
    seconds = timeout_seconds(timeout, settings.timeout)
    master: str | None = None
    owns_store = store is None
    if store is None:
        store, rank, world_size, master = _rendezvous(init_method or "env://", rank,
                                                      world_size, seconds, os.environ)
    elif init_method is not None:
        raise ArgumentError("pass either store= or init_method=, not both")
    else:
        master = os.environ.get("MASTER_ADDR")
    _check_rank(rank, world_size)
    # every init on the same store gets a fresh namespace, so a re-init never reads
    # the addresses of the previous incarnation
    generation = (store.add("tandem/inits", 1) - 1) // world_size
    scoped = PrefixStore(f"tandem/{generation}", store)
    options = BackendOptions(store=scoped, rank=rank, world_size=world_size,
                             host=bind_address(settings, master),
                             hostname=os.environ.get("TANDEM_HOST_ID") or socket.gethostname(),
                             secret=load_secret(), settings=settings)
    transport = Backend.factory(backend_name)(options)
    default = ProcessGroup(transport, list(range(world_size)), 0, group_name or "default",
                           seconds, settings, backend_name)
    _world = World(default, store, transport, settings, backend_name, generation, owns_store)
    # [observability hook] stall warnings, flight-recorder dumps, timeline (monitor.py)
    _world.monitor = Monitor(rank, world_size, settings, transport.mailbox,
                             PrefixStore("watch", scoped), _world.process_groups)
    _world.monitor.adopt(default)


def destroy_process_group(group: ProcessGroup | NonMemberGroup | None = None) -> None:
    """Tear down ``group``, or everything (the default group, transport, store) if None."""
    global _world
    w = _require()
    if group is not None and group is not w.default:
        if isinstance(group, ProcessGroup):
            group.close()
        if group in w.groups:
            w.groups.remove(group)
        return
    _world = None
    if w.monitor is not None:  # [observability hook] before the groups go
        w.monitor.close()
    for g in w.groups:
        if isinstance(g, ProcessGroup):
            g.close()
    w.default.close()
    w.transport.close()
    if w.owns_store:  # a store the caller passed in stays theirs to reuse
        w.store.close()


def _require() -> World:
    if _world is None:
        raise StateError(
            "tandem is not initialised: call tandem.init_process_group() first")
    return _world


def is_initialized() -> bool:
    return _world is not None


def is_available() -> bool:
    return True


def world() -> World:
    return _require()


def default_group() -> ProcessGroup:
    return _require().default


def resolve_group(group: AnyGroup | None, what: str) -> ProcessGroup:
    """The group a call runs on; a rank outside ``group`` gets a clear error."""
    if group is None:
        return _require().default
    if isinstance(group, NonMemberGroup):
        raise group.error(what)
    if not isinstance(group, ProcessGroup):
        raise ArgumentError(f"{what}: group must be a tandem ProcessGroup, got {group!r}")
    return group


def get_rank(group: AnyGroup | None = None) -> int:
    if isinstance(group, NonMemberGroup):
        return -1
    return resolve_group(group, "get_rank").group_rank


def get_world_size(group: AnyGroup | None = None) -> int:
    if isinstance(group, NonMemberGroup):
        return group.size()
    return resolve_group(group, "get_world_size").group_size


def get_backend(group: AnyGroup | None = None) -> str:
    return resolve_group(group, "get_backend").backend
