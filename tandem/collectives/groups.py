"""Subgroups: new_group, new_subgroups and rank translation.

As in torch, every rank of the job calls ``new_group`` with the same arguments in
the same order (the group's identity is its position in that order). Members get
a working group; other ranks get a handle whose every use raises, naming the
rank and the group, instead of silently doing nothing.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Sequence

from tandem.collectives.group import NonMemberGroup, ProcessGroup, timeout_seconds
from tandem.collectives.world import AnyGroup, resolve_group, world
from tandem.errors import ArgumentError

__all__ = ["new_group", "new_subgroups", "new_subgroups_by_enumeration", "get_group_rank",
           "get_global_rank", "get_process_group_ranks"]


def new_group(ranks: Sequence[int] | None = None,
              timeout: float | datetime.timedelta | None = None, backend: str | None = None,
              pg_options: Any = None, use_local_synchronization: bool = False,
              group_desc: str | None = None, device_id: Any = None,
              sort_ranks: bool = True) -> AnyGroup:
    w = world()
    size = w.default.group_size
    members = list(range(size) if ranks is None else ranks)
    if sort_ranks:
        members.sort()
    if len(set(members)) != len(members):
        raise ArgumentError(f"new_group: ranks {list(ranks or [])} contain duplicates")
    bad = [r for r in members if not 0 <= r < size]
    if bad:
        raise ArgumentError(f"new_group: ranks {bad} are outside the world [0, {size})")
    if not members:
        raise ArgumentError("new_group: ranks is empty")
    w.groups_made += 1
    group_id = w.groups_made
    name = group_desc or f"group{group_id}"
    me = w.transport.rank
    group: AnyGroup
    if me in members:
        group = ProcessGroup(w.transport, members, group_id, name,
                             timeout_seconds(timeout, w.default.timeout), w.settings,
                             w.default.backend)
        if w.monitor is not None:  # [observability hook]
            w.monitor.adopt(group)
    else:
        group = NonMemberGroup(members, name, me)
    w.groups.append(group)
    return group


def new_subgroups_by_enumeration(ranks_per_subgroup_list: Sequence[Sequence[int]],
                                 timeout: float | datetime.timedelta | None = None,
                                 backend: str | None = None,
                                 pg_options: Any = None) -> tuple[AnyGroup | None, list[AnyGroup]]:
    seen: set[int] = set()
    for ranks in ranks_per_subgroup_list:
        overlap = seen.intersection(ranks)
        if overlap:
            raise ArgumentError(f"new_subgroups_by_enumeration: ranks {sorted(overlap)} are in "
                                f"more than one subgroup")
        seen.update(ranks)
    groups = [new_group(r, timeout) for r in ranks_per_subgroup_list]
    mine = next((g for g in groups if isinstance(g, ProcessGroup)), None)
    return mine, groups


def new_subgroups(group_size: int | None = None, group: AnyGroup | None = None,
                  timeout: float | datetime.timedelta | None = None, backend: str | None = None,
                  pg_options: Any = None,
                  group_desc: str | None = None) -> tuple[AnyGroup | None, list[AnyGroup]]:
    """Split the world into consecutive subgroups of ``group_size`` ranks.

    ``group_size`` defaults to ``LOCAL_WORLD_SIZE`` (ranks per node), as set by the
    launcher.
    """
    size = world().default.group_size
    if group_size is None:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if not local:
            raise ArgumentError("new_subgroups: pass group_size (LOCAL_WORLD_SIZE is not set)")
        group_size = int(local)
    if group_size <= 0 or size % group_size:
        raise ArgumentError(f"new_subgroups: group_size={group_size} must divide the world "
                            f"size {size}")
    enumeration = [list(range(s, s + group_size)) for s in range(0, size, group_size)]
    return new_subgroups_by_enumeration(enumeration, timeout)


def get_process_group_ranks(group: AnyGroup | None) -> list[int]:
    if isinstance(group, NonMemberGroup):
        return list(group.ranks)
    return list(resolve_group(group, "get_process_group_ranks").ranks)


def get_group_rank(group: AnyGroup | None, global_rank: int) -> int:
    ranks = get_process_group_ranks(group)
    if global_rank not in ranks:
        raise ArgumentError(f"get_group_rank: global rank {global_rank} is not in group {ranks}")
    return ranks.index(global_rank)


def get_global_rank(group: AnyGroup | None, group_rank: int) -> int:
    ranks = get_process_group_ranks(group)
    if not 0 <= group_rank < len(ranks):
        raise ArgumentError(f"get_global_rank: group rank {group_rank} is outside "
                            f"[0, {len(ranks)})")
    return ranks[group_rank]
