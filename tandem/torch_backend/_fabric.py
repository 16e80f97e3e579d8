"""Fabrics: the tandem transports that torch's process groups share.

torch calls the backend factory once per process group: for the default group, then
for every ``new_group`` / ``new_subgroups`` / DeviceMesh dimension, each time with a
store prefixed for that group and the group's ranks. Connecting a fresh mesh of
sockets and shared-memory rings per group would multiply connections and start-up
time by the number of groups, so a *fabric* (one tandem transport over a set of
global ranks) serves every group whose members it connects: each such group is a
tandem :class:`~tandem.collectives.group.ProcessGroup` on the fabric, with its own
group id, sequence numbers and staging memory, as ``tandem.new_group`` makes them.

When tandem is torch's default backend, the default group's fabric connects every
rank and all subgroups use it. A tandem subgroup under another default backend
(``init_process_group("gloo")`` then ``new_group(backend="tandem")``) gets a fabric
over its own members, which later groups within those members reuse.

Each fabric runs one :class:`~tandem.collectives.process_monitor.Monitor` over its groups, as
tandem's own ``init_process_group`` does for its groups: stall warnings
(``TANDEM_STALL_WARN``), flight-recorder dumps when a call fails or a peer is lost,
and the timeline. Its store exchange (what a stalled peer is doing) runs under the
fabric's own prefix of the store torch handed the factory.

The registry below is module state because torch's factory receives no context to
hang it on; fabrics leave it when their last group shuts down.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import threading
import zlib

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from tandem import _wire
from tandem.collectives.backend import Backend, BackendOptions, resolve_backend
from tandem.collectives.group import ProcessGroup
from tandem.collectives.process_monitor import Monitor
from tandem.collectives.world import bind_address
from tandem.config import Settings, load_secret, load_settings
from tandem.errors import StateError
from tandem.store.prefix import PrefixStore
from tandem.transport.base import Transport
from tandem.torch_backend._store import TorchStore, master_address

__all__ = ["Fabric", "join_group", "group_timeout"]


@dataclasses.dataclass(eq=False)
class Fabric:
    """One tandem transport; ``members[i]`` is the global rank of transport rank ``i``."""

    transport: Transport
    members: list[int]
    settings: Settings
    transport_name: str
    group_ids: dict[int, str] = dataclasses.field(default_factory=dict)
    groups: dict[int, ProcessGroup] = dataclasses.field(default_factory=dict)
    monitor: Monitor | None = None  # stall warnings, dumps, timeline (see the module doc)

    def live_groups(self) -> list[ProcessGroup]:
        with _lock:
            return list(self.groups.values())

    def connects(self, ranks: list[int]) -> bool:
        return set(ranks) <= set(self.members)

    def global_rank(self, transport_rank: int) -> int:
        if 0 <= transport_rank < len(self.members):
            return self.members[transport_rank]
        return transport_rank

    def release(self, group_id: int) -> None:
        """Forget one group; the last one closes the transport."""
        with _lock:
            self.group_ids.pop(group_id, None)
            self.groups.pop(group_id, None)
            last = not self.group_ids
            if last and self in _fabrics:
                _fabrics.remove(self)
        if last:
            if self.monitor is not None:  # its threads stop before the transport goes
                self.monitor.close()
            self.transport.close()


_fabrics: list[Fabric] = []  # live fabrics, oldest first (every member lists them alike)
_lock = threading.Lock()


def group_timeout(timeout: datetime.timedelta | None, settings: Settings) -> float:
    """Seconds a group's calls may take: the caller's timeout, else ``TANDEM_TIMEOUT``.

    torch passes its 30-minute default when the caller gave none; then an explicit
    ``TANDEM_TIMEOUT`` wins, so the same knob works with and without torch's API.
    """
    if timeout is None or (timeout == default_pg_timeout and "TANDEM_TIMEOUT" in os.environ):
        return settings.timeout
    return timeout.total_seconds()


def _group_id(name: str, fabric: Fabric) -> int:
    # every member derives the same id from torch's group name, which all members share;
    # 0 stays free (tandem's own default group uses it)
    gid = (zlib.crc32(name.encode()) & 0x7FFFFFFF) or 1
    taken = fabric.group_ids.get(gid)
    if taken is not None:
        raise StateError(f"torch process groups '{taken}' and '{name}' hash to the same tandem "
                         f"group id {gid}; create the group with another group_desc or name")
    return gid


def _connect(store: dist.Store, rank: int, size: int, members: list[int],
             transport_name: str, settings: Settings) -> Fabric:
    tandem_store = TorchStore(store, settings.connect_timeout)
    # a re-created group on the same store must not read the previous one's addresses
    generation = (tandem_store.add("tandem/inits", 1) - 1) // size
    master = master_address(store) or os.environ.get("MASTER_ADDR")
    host = bind_address(settings, master)
    options = BackendOptions(store=PrefixStore(f"tandem/{generation}", tandem_store), rank=rank,
                             world_size=size, host=host,
                             advertise=_wire.advertised_address(host, master),
                             hostname=settings.host_id or socket.gethostname(),
                             secret=load_secret(), settings=settings)
    name = resolve_backend(transport_name)
    transport = Backend.factory(name)(options)
    fabric = Fabric(transport, members, settings, transport_name)
    fabric.monitor = Monitor(rank, size, settings, transport,
                             PrefixStore(f"tandem/{generation}/watch", tandem_store),
                             fabric.live_groups)
    return fabric


def join_group(store: dist.Store, group_rank: int, group_size: int, global_ranks: list[int],
               group_name: str, timeout: datetime.timedelta | None,
               transport_name: str | None) -> tuple[ProcessGroup, Fabric]:
    """The tandem group for one torch process group, on a shared fabric where possible.

    ``global_ranks`` is empty for torch's default group (then the ranks are the world).
    ``transport_name`` (``"auto"``, ``"shm"``, ``"tcp"``; None: any) picks the transport.
    """
    members = list(global_ranks) or list(range(group_size))
    if len(members) != group_size or not 0 <= group_rank < group_size:
        raise StateError(f"torch created group '{group_name}' with rank {group_rank} of "
                         f"{group_size} over global ranks {members}: inconsistent")
    settings = load_settings()
    with _lock:
        fabric = next((f for f in _fabrics if f.connects(members)
                       and transport_name in (None, f.transport_name)), None)
    if fabric is None:
        fabric = _connect(store, group_rank, group_size, members, transport_name or "auto",
                          settings)
        with _lock:
            _fabrics.append(fabric)
    index = {g: i for i, g in enumerate(fabric.members)}
    with _lock:
        gid = _group_id(group_name, fabric)
        fabric.group_ids[gid] = group_name
    group = ProcessGroup(fabric.transport, [index[g] for g in members], gid,
                         f"torch:{group_name}", group_timeout(timeout, settings), settings,
                         "tandem")
    with _lock:
        fabric.groups[gid] = group
    if fabric.monitor is not None:
        fabric.monitor.adopt(group)
    return group, fabric
