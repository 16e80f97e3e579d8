"""Rank function of test_shm_bounds (module level, so spawned children can import it)."""

from __future__ import annotations

from typing import Any

import torch

import tandem
import tandem.config


def arena_on_a_smaller_machine(rank: int, world_size: int, memory: int) -> dict[str, Any]:
    """Settings were read on the real machine; the arena is then made as if this one had
    ``memory`` bytes: its staging must be refused before it is reserved. The rank that
    refuses first aborts the group, so the other may hear of it from that rank."""
    tandem.config._memory[:] = [memory]
    return _first_all_reduce()


def arena_past_the_address_space_limit(rank: int, world_size: int,
                                       room: int) -> dict[str, Any]:
    """The host has the memory, but this process may map only ``room`` bytes more
    (ulimit -v): the arena's mapping fails, and the error must say which setting asks."""
    import resource

    with open("/proc/self/status") as f:
        size = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS,
                       (size + room, resource.getrlimit(resource.RLIMIT_AS)[1]))
    return _first_all_reduce()


def _first_all_reduce() -> dict[str, Any]:
    """The group's first call, which makes its arena: refused (why) or its result."""
    t = torch.ones(4)
    try:
        tandem.all_reduce(t)
    except tandem.errors.TandemError as exc:
        return {"refused": str(exc)}
    return {"refused": "", "result": t.tolist()}
