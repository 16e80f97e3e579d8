"""Initialisation and the default-group registry that torch's API requires.

``init_process_group`` finds the store (``env://``, ``tcp://``, ``file://`` or a
given ``store``), connects the transport and creates the default group. The
``_world`` registry below is the one piece of module-level state in tandem: the
torch-compatible functions (``all_reduce(t)`` without a group) need it.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import datetime
import os
import socket
from typing import Callable

from tandem._words import secs
from tandem import _wire
from tandem.collectives.backend import DEFAULT_GROUP_ID, Backend, BackendOptions, resolve_backend
from tandem.collectives.checks import check_cpu_device, refuse_pg_options
from tandem.collectives.group import NonMemberGroup, ProcessGroup
from tandem.collectives.init_method import check_rank, open_store
from tandem.collectives.process_monitor import Monitor
from tandem.collectives.timeline import Timeline
from tandem.collectives.watchdog import EarlyThread
from tandem.config import Settings, load_secret, load_settings, timeout_seconds
from tandem.errors import (ArgumentError, NetworkError, StateError, StoreTimeoutError, TandemError,
                           TimeoutError)
from tandem.store.base import Store, check_store
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

# How long destroy_process_group on the store's host waits for the other ranks to hang
# up before its server goes (a rank that stopped or never destroys costs this much).
LEAVE_LINGER = 10.0


@dataclasses.dataclass
class World:
    default: ProcessGroup
    store: Store
    transport: Transport
    settings: Settings
    backend: str
    generation: int
    owns_store: bool
    scoped: Store  # this incarnation's namespace in ``store`` (group ids live here)
    groups: list[AnyGroup] = dataclasses.field(default_factory=list)
    # groups this rank created per set of members (see groups.new_group)
    created: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    monitor: Monitor | None = None  # watchdog, flight-recorder dumps, timeline

    def process_groups(self) -> list[ProcessGroup]:
        """The groups this rank is a member of, the default group first."""
        return [self.default] + [g for g in self.groups if isinstance(g, ProcessGroup)]


_world: World | None = None


def bind_address(settings: Settings, master_addr: str | None) -> str:
    """Where this rank's transport listens: loopback for single-host jobs."""
    if settings.bind_addr:
        return _wire.check_bind_address(settings.bind_addr, "TANDEM_BIND_ADDR")
    if master_addr is None or _wire.is_loopback(master_addr):
        return "127.0.0.1"
    if _wire.is_wildcard(master_addr):
        return master_addr  # MASTER_ADDR=0.0.0.0: every interface, as the store listens
    try:
        return _wire.route_address(master_addr)
    except OSError as exc:
        raise ArgumentError(
            f"cannot find the local address that reaches MASTER_ADDR={master_addr}: {exc}; "
            f"set TANDEM_BIND_ADDR") from exc


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
    """Join the job: connect to every other rank and create the default group.

    ``timeout`` is the deadline of every collective (default ``TANDEM_TIMEOUT``). Set-up
    (reaching the store, finding and connecting the peers) waits at most
    ``TANDEM_CONNECT_TIMEOUT`` (60 s), or ``timeout`` if that is shorter. ``device_id``
    may be None or the CPU; ``pg_options`` must be None.
    """
    if _world is not None:
        raise StateError("tandem is already initialised; call destroy_process_group() first")
    settings = load_settings()
    backend_name = resolve_backend(backend)
    seconds = timeout_seconds(timeout, settings.timeout, "init_process_group: timeout")
    refuse_pg_options("init_process_group", pg_options)
    check_cpu_device("init_process_group", "device_id", device_id)
    setup = min(settings.connect_timeout, seconds)
    # the watchdog's thread starts once this rank's entry is in the store (the transport
    # calls back), its start (a wait for a CPU) overlapping the wait for the other ranks
    # and never delaying what they wait for; it is handed its work at the end of init
    early = (EarlyThread("tandem-watchdog", setup + 5.0, start=False)
             if settings.flight_recorder > 0 else None)
    try:
        _init(backend_name, init_method, seconds, world_size, rank, store, group_name,
              settings, setup, early)
    except BaseException:
        if early is not None:
            early.cancel()
        raise


def _init(backend_name: str, init_method: str | None, seconds: float, world_size: int,
          rank: int, store: Store | None, group_name: str, settings: Settings, setup: float,
          early: EarlyThread | None) -> None:
    global _world
    master: str | None = None
    owns_store = store is None
    if store is None:
        store, rank, world_size, master = open_store(init_method or "env://", rank,
                                                     world_size, seconds, setup, os.environ)
    elif init_method is not None:
        raise ArgumentError("pass either store= or init_method=, not both")
    else:
        check_rank(rank, world_size)
        check_store("init_process_group", store)
        master = os.environ.get("MASTER_ADDR")
    try:
        if settings.timeline:  # refused now: the monitor that writes it comes last
            Timeline(settings.timeline, rank).check_writable("TANDEM_TIMELINE")
        # every init on the same store gets a fresh namespace, so a re-init never reads
        # the addresses of the previous incarnation
        generation = (store.add("tandem/inits", 1) - 1) // world_size
        scoped = PrefixStore(f"tandem/{generation}", store)
        scoped.set_timeout(setup)  # peers' addresses must appear within the connect deadline
        _claim(scoped, rank)
        transport = _connect(scoped, rank, world_size, backend_name, settings, master, setup,
                             None if early is None else early.start)
        try:
            default = ProcessGroup(transport, list(range(world_size)), DEFAULT_GROUP_ID,
                                   group_name or "default", seconds, settings, backend_name)
        except BaseException:
            transport.close()
            raise
    except BaseException:
        if owns_store:  # a failed start leaves no store connection or server behind
            store.close()
        raise
    scoped.set_timeout(seconds)  # later store use (new_group) is bounded by the op timeout
    _world = World(default, store, transport, settings, backend_name, generation, owns_store,
                   scoped)
    # [observability hook] stall warnings, flight-recorder dumps, timeline (process_monitor.py)
    _world.monitor = Monitor(rank, world_size, settings, transport,
                             PrefixStore("watch", scoped), _world.process_groups, early)
    _world.monitor.adopt(default)
    atexit.unregister(tell_failures_at_exit)  # registered once however often ranks re-init
    atexit.register(tell_failures_at_exit)


def tell_failures_at_exit() -> None:
    """At exit, a rank where a group failed (it raised, or a peer told it why) tells its
    peers why before its connections close, and lets the abort messages it began send go
    out: the transport's polite leave, bounded by a second or two.

    A script that raises exits without destroy_process_group, and its threads telling 63
    peers were cut off: at 8 hosts x 8, 23 of 64 ranks then blamed a rank that had only
    exited (a PeerLostError) instead of the mismatch it reported (measured).
    """
    w = _world
    if w is None or not any(w.transport.aborted(g.group_id) is not None
                            for g in w.process_groups()):
        return
    try:
        w.transport.close()
    except Exception:  # noqa: BLE001 - exiting anyway; what could be told was told
        pass


def _claim(store: Store, rank: int) -> None:
    """Refuse a rank that another process of this generation already took: both would
    otherwise wait for the rank nobody took and time out calling it "never started"."""
    if store.add(f"claims/{rank}", 1) > 1:
        raise ArgumentError(
            f"rank {rank} was given to two processes of this job (another process already "
            f"joined as rank {rank}); every process needs its own rank (check RANK, or the "
            f"rank= each process passes)")


def _connect(store: Store, rank: int, world_size: int, backend: str, settings: Settings,
             master: str | None, setup: float,
             published: Callable[[], None] | None = None) -> Transport:
    """Build this rank's transport through ``store``, whose deadline is ``setup``."""
    host = bind_address(settings, master)
    # the transports connect within settings.connect_timeout: the init timeout, if shorter
    if settings.connect_timeout != setup:  # (a replace checks every setting again)
        settings = dataclasses.replace(settings, connect_timeout=setup)
    options = BackendOptions(store=store, rank=rank, world_size=world_size, host=host,
                             advertise=_wire.advertised_address(host, master),
                             hostname=settings.host_id or socket.gethostname(),
                             secret=load_secret(), settings=settings, published=published)
    try:
        return Backend.factory(backend)(options)
    except (TimeoutError, NetworkError) as exc:
        claims = _claims(store, rank)
        if claims > 1:  # the real cause of the missing peer
            raise ArgumentError(
                f"rank {rank} was claimed by {claims} processes of this job, so some other "
                f"rank was never given out and the job could not form ({exc})") from exc
        if not isinstance(exc, StoreTimeoutError):
            raise
        raise StoreTimeoutError(
            f"rank {rank}: the job of {world_size} ranks did not form within {secs(setup)}s "
            f"(TANDEM_CONNECT_TIMEOUT, or the init timeout if shorter): {exc}; a rank whose "
            f"entry is missing never started, or cannot reach the store") from exc


def _claims(store: Store, rank: int) -> int:
    """How many processes joined this generation as ``rank`` (1 if that cannot be read)."""
    try:
        return int(store.get(f"claims/{rank}")) if store.check([f"claims/{rank}"]) else 1
    except (TandemError, ValueError):
        return 1


def destroy_process_group(group: ProcessGroup | NonMemberGroup | None = None) -> None:
    """Tear down ``group``, or everything (the default group, transport, store) if None.

    Operations still pending on a destroyed group fail at once with ``StateError``;
    once everything is torn down no thread, descriptor or mapping of tandem remains.
    A TCP store's host (rank 0 under ``env://`` and ``tcp://``) first waits, up to
    ``LEAVE_LINGER`` seconds, for the other ranks to leave its store, so that
    ``init_process_group`` may follow at once on every rank, on the same address.
    A broadcast root's check left to the next call (``ProcessGroup.confirm_later``) that
    fails by then is raised here, once everything is torn down.
    """
    global _world
    w = _require()
    if group is not None and group is not w.default:
        try:
            if isinstance(group, ProcessGroup):
                group.close()
        finally:
            if group in w.groups:
                w.groups.remove(group)
        return
    _world = None
    failure: TandemError | None = None  # a group's last broadcast that failed its root check
    try:
        if w.monitor is not None:  # [observability hook] before the groups go
            w.monitor.close()
        for g in [*w.groups, w.default]:
            if isinstance(g, ProcessGroup):
                try:
                    g.close()
                except TandemError as exc:  # every group still closes; the first is raised
                    failure = failure or exc
    finally:
        try:
            w.transport.close()
        finally:
            if w.owns_store and isinstance(w.store, TCPStore):
                # a re-init on this address must meet the next server, not this one
                w.store.leave(LEAVE_LINGER)
            elif w.owns_store:  # a store the caller passed in stays theirs to reuse
                w.store.close()
    if failure is not None:
        raise failure


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
    """The number of ranks in ``group``; -1 on a rank outside it (as torch)."""
    if isinstance(group, NonMemberGroup):
        return -1
    return resolve_group(group, "get_world_size").group_size


def get_backend(group: AnyGroup | None = None) -> str:
    return resolve_group(group, "get_backend").backend
