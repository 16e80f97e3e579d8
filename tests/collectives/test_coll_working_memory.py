"""A rank that cannot allocate a call's working memory says so, and its peers learn it at
once (torch's allocator error names neither the call nor why a collective allocates)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import tandem
from tandem.collectives import group as group_module
from tandem.config import Settings
from tandem.testing import run_threads

pytestmark = pytest.mark.timeout(120)

OP_TIMEOUT = 30.0


def test_working_memory_that_cannot_be_allocated_is_named_on_every_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    empty = torch.empty
    starved: list[str] = []  # the thread of rank 0, whose allocations fail as under ulimit -v

    def limited(*args: Any, **kwargs: Any) -> torch.Tensor:
        if starved and threading.current_thread().name == starved[0] and args and args[0] > 1024:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. "
                               "DefaultCPUAllocator: can't allocate memory: you tried to "
                               f"allocate {args[0]} bytes. Error code 12")
        return empty(*args, **kwargs)

    monkeypatch.setattr(group_module.torch, "empty", limited)

    def body(g: Any) -> tuple[str, str]:
        if g.rank() == 0:
            starved.append(threading.current_thread().name)
        try:
            tandem.all_reduce(torch.ones(1 << 16), group=g)
        except Exception as exc:  # noqa: BLE001 - compared below
            return type(exc).__name__, str(exc)
        return "ok", ""

    settings = Settings(algorithm="doubling")  # working memory: the whole tensor
    results = run_threads(2, body, op_timeout=OP_TIMEOUT, timeout=100, settings=settings)
    for rank, (kind, text) in enumerate(results):
        assert "rank 0 cannot allocate the 256 KiB of working memory" in text, \
            f"rank {rank}: {kind}: {text}"
        assert "timed out" not in text, f"rank {rank}: {text}"
