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
    t = torch.ones(4)
    try:
        tandem.all_reduce(t)
    except tandem.errors.TandemError as exc:
        return {"refused": str(exc)}
    return {"refused": "", "result": t.tolist()}
