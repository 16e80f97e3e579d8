"""Subgroups: new_group, new_subgroups and rank translation.

Only a group's members need to call ``new_group`` for it (as torch promises with
``use_local_synchronization=True``; calls by other ranks are allowed and cost nothing), and
nobody waits for anybody: creating groups never blocks, so overlapping groups created
by their own members in any order cannot deadlock. Members agree on the group through
the job's store: the k-th group a rank creates with a given *set* of members is the
same group on every member, and the first member to create it fixes its number and its
rank order. A member that passes another order (``sort_ranks=False``) gets a
``CollectiveMismatchError`` at creation, and the members that agreed are told at once,
so their first call on the group fails too instead of combining in two orders.

Ranks outside a group get a handle whose every use raises, naming the rank and the
group, instead of silently doing nothing.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
from typing import Any, Sequence

from tandem._words import in_order

from tandem.collectives.backend import resolve_backend
from tandem.collectives.checks import bool_arg, check_cpu_device, int_list, refuse_pg_options
from tandem.collectives.group import NonMemberGroup, ProcessGroup
from tandem.collectives.world import AnyGroup, World, resolve_group, world
from tandem.config import timeout_seconds
from tandem.errors import ArgumentError, CollectiveMismatchError

__all__ = ["new_group", "new_subgroups", "new_subgroups_by_enumeration", "get_group_rank",
           "get_global_rank", "get_process_group_ranks"]

_LISTED = 8  # runs of ranks a refusal names before it gives the count


def new_group(ranks: Sequence[int] | None = None,
              timeout: float | datetime.timedelta | None = None, backend: str | None = None,
              pg_options: Any = None, use_local_synchronization: bool = False,
              group_desc: str | None = None, device_id: Any = None,
              sort_ranks: bool = True) -> AnyGroup:
    """A group of the global ``ranks`` (all ranks if None); see the module docstring.

    ``backend`` may be None, the job's backend, or ``"gloo"`` (torch scripts ask for gloo
    to get a CPU group; every tandem group is one, on the job's transport); ``pg_options``
    must be None and ``device_id`` None or the CPU. With ``sort_ranks=False`` the group
    ranks follow the order given, which every member must give alike.
    """
    w = world()
    seconds = timeout_seconds(timeout, w.default.timeout, "new_group: timeout")
    check_backend("new_group", backend, w.backend)
    refuse_pg_options("new_group", pg_options)
    check_cpu_device("new_group", "device_id", device_id)
    bool_arg(use_local_synchronization, "new_group", "use_local_synchronization")
    bool_arg(sort_ranks, "new_group", "sort_ranks")
    size = w.default.group_size
    members = list(range(size)) if ranks is None else int_list(ranks, "new_group", "ranks")
    if sort_ranks:
        members.sort()
    if len(set(members)) != len(members):
        twice = sorted(r for r, n in collections.Counter(members).items() if n > 1)
        raise ArgumentError(f"new_group: ranks {in_order(twice, _LISTED)} are given more than "
                            f"once; each rank may appear once")
    bad = [r for r in members if not 0 <= r < size]
    if bad:
        raise ArgumentError(f"new_group: ranks {in_order(bad, _LISTED)} are outside the "
                            f"world [0, {size})")
    if not members:
        raise ArgumentError("new_group: ranks is empty")
    me = w.transport.rank
    group: AnyGroup
    if me not in members:
        group = NonMemberGroup(members, group_desc or f"ranks {members}", me)
    else:
        group_id = _agree(w, members, me)
        group = ProcessGroup(w.transport, members, group_id, group_desc or f"group{group_id}",
                             seconds, w.settings, w.default.backend)
        if w.monitor is not None:  # [observability hook]
            w.monitor.adopt(group)
    w.groups.append(group)
    return group


def _agree(w: World, members: list[int], me: int) -> int:
    """The group's number, the same on every member; check that the order agrees too."""
    membership = ",".join(map(str, sorted(members)))
    key = "groups/" + hashlib.sha256(membership.encode()).hexdigest()[:32]
    nth = w.created[key]
    w.created[key] += 1
    candidate = w.scoped.add("groups/next_id", 1)  # ids are unique across the job
    order = ",".join(map(str, members))
    fixed = w.scoped.compare_set(f"{key}/{nth}", "", f"{candidate}|{me}|{order}").decode()
    number, creator, their_order = fixed.split("|")
    group_id = int(number)
    if their_order != order:
        error = CollectiveMismatchError(
            f"new_group: rank {me} gave the ranks in the order {members} but rank {creator} "
            f"created this group (global ranks {sorted(members)}) in the order "
            f"[{their_order.replace(',', ', ')}]; group ranks follow this order, so every "
            f"member must pass the same one (or leave sort_ranks=True)")
        w.transport.abort(group_id, members, error)  # members that agreed must not go on
        raise error
    return group_id


def check_backend(what: str, backend: str | None, job_backend: str) -> None:
    if backend is None:
        return
    name = resolve_backend(backend)  # torch's GPU backends are refused there, with a reason
    if name == job_backend or str(backend).lower() in ("gloo", "cpu:gloo"):
        return
    raise ArgumentError(f"{what}: backend={backend!r}: every group of a job runs on the job's "
                        f"transport ('{job_backend}'); pass None, or choose the backend in "
                        f"init_process_group")


def new_subgroups_by_enumeration(ranks_per_subgroup_list: Sequence[Sequence[int]],
                                 timeout: float | datetime.timedelta | None = None,
                                 backend: str | None = None, pg_options: Any = None,
                                 group_desc: str | None = None
                                 ) -> tuple[AnyGroup | None, list[AnyGroup]]:
    """One group per list of global ranks; returns (this rank's group or None, all of them)."""
    what = "new_subgroups_by_enumeration"
    if not isinstance(ranks_per_subgroup_list, (list, tuple)) or not ranks_per_subgroup_list:
        raise ArgumentError(f"{what}: ranks_per_subgroup_list must be a non-empty list of "
                            f"lists of ranks")
    seen: set[int] = set()
    for ranks in ranks_per_subgroup_list:
        ranks = int_list(ranks, what, "ranks_per_subgroup_list entries")
        overlap = seen.intersection(ranks)
        if overlap:
            raise ArgumentError(f"{what}: ranks {sorted(overlap)} are in more than one subgroup")
        seen.update(ranks)
    groups = [new_group(r, timeout, backend, pg_options, group_desc=group_desc)
              for r in ranks_per_subgroup_list]
    mine = next((g for g in groups if isinstance(g, ProcessGroup)), None)
    return mine, groups


def new_subgroups(group_size: int | None = None, group: AnyGroup | None = None,
                  timeout: float | datetime.timedelta | None = None, backend: str | None = None,
                  pg_options: Any = None,
                  group_desc: str | None = None) -> tuple[AnyGroup | None, list[AnyGroup]]:
    """Split ``group`` (default: the world) into consecutive subgroups of ``group_size``.

    ``group_size`` defaults to ``LOCAL_WORLD_SIZE`` (ranks per node, set by the
    launcher). Only the members of ``group`` call it.
    """
    parent = resolve_group(group, "new_subgroups")
    if group_size is None:
        group_size = world().settings.local_world_size
        if group_size is None:
            raise ArgumentError("new_subgroups: pass group_size (LOCAL_WORLD_SIZE is not set)")
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        raise ArgumentError(f"new_subgroups: group_size must be an int, got {group_size!r}")
    size = parent.group_size
    if group_size <= 0 or size % group_size:
        raise ArgumentError(f"new_subgroups: group_size={group_size} must divide the size "
                            f"{size} of group '{parent.group_name}'")
    ranks = parent.ranks
    enumeration = [ranks[s:s + group_size] for s in range(0, size, group_size)]
    return new_subgroups_by_enumeration(enumeration, timeout, backend, pg_options, group_desc)


def get_process_group_ranks(group: AnyGroup | None) -> list[int]:
    if isinstance(group, NonMemberGroup):
        return list(group.ranks)
    return list(resolve_group(group, "get_process_group_ranks").ranks)


def get_group_rank(group: AnyGroup | None, global_rank: int) -> int:
    ranks = get_process_group_ranks(group)
    if global_rank not in ranks or isinstance(global_rank, bool):
        raise ArgumentError(f"get_group_rank: global rank {global_rank!r} is not in group "
                            f"{ranks}")
    return ranks.index(global_rank)


def get_global_rank(group: AnyGroup | None, group_rank: int) -> int:
    ranks = get_process_group_ranks(group)
    if not isinstance(group_rank, int) or not 0 <= group_rank < len(ranks):
        raise ArgumentError(f"get_global_rank: group rank {group_rank!r} is outside "
                            f"[0, {len(ranks)})")
    return ranks[group_rank]
