"""Porting is one changed import: tandem exposes torch.distributed's names with
compatible parameters, and its public surface is exactly ``__all__``."""

from __future__ import annotations

import inspect

import pytest
import torch.distributed as tdist

import tandem

# the c10d functions a training script uses, with the parameters it may pass by name
FUNCTIONS = [
    "init_process_group", "destroy_process_group", "is_initialized", "is_available",
    "get_rank", "get_world_size", "get_backend", "new_group", "new_subgroups",
    "get_group_rank", "get_global_rank", "get_process_group_ranks",
    "broadcast", "all_reduce", "all_reduce_coalesced", "reduce", "all_gather", "all_gather_into_tensor", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list",
]
CLASSES = ["ReduceOp", "P2POp", "Work", "TCPStore", "FileStore", "HashStore", "PrefixStore",
           "Store", "Backend", "ProcessGroup"]


def test_all_lists_exactly_the_public_names() -> None:
    missing = [n for n in tandem.__all__ if not hasattr(tandem, n)]
    assert not missing, f"tandem.__all__ names that do not exist: {missing}"
    assert len(set(tandem.__all__)) == len(tandem.__all__), "duplicate names in __all__"


@pytest.mark.parametrize("name", FUNCTIONS + CLASSES)
def test_torch_name_exists(name: str) -> None:
    assert hasattr(tdist, name), f"test list is wrong: torch.distributed has no {name}"
    assert name in tandem.__all__, f"tandem does not export torch.distributed.{name}"


@pytest.mark.parametrize("name", FUNCTIONS)
def test_parameters_accept_torch_call_styles(name: str) -> None:
    """Every parameter torch documents can be passed to tandem by the same name and position."""
    theirs = inspect.signature(getattr(tdist, name)).parameters
    ours = inspect.signature(getattr(tandem, name)).parameters
    missing = [p for p in theirs if p not in ours and not p.startswith("_")]
    assert not missing, f"tandem.{name} lacks torch's parameters {missing}"
    positional = [p for p, v in theirs.items() if v.kind in
                  (v.POSITIONAL_ONLY, v.POSITIONAL_OR_KEYWORD) and not p.startswith("_")]
    ours_positional = [p for p, v in ours.items() if v.kind in
                       (v.POSITIONAL_ONLY, v.POSITIONAL_OR_KEYWORD)]
    assert ours_positional[: len(positional)] == positional, (
        f"tandem.{name} positional order {ours_positional} differs from torch's {positional}")


def test_reduce_ops_match_torch_names() -> None:
    for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"):
        assert hasattr(tdist.ReduceOp, op)
        assert getattr(tandem.ReduceOp, op).name == op
