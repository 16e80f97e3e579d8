"""Where torch's DDP hangs or silently diverges, tandem's raises a message that says why.

Run: ``python -m pytest tests/parallel/test_ddp_errors.py -q``.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable

import pytest
import torch
from torch import nn

import tandem
from tandem.errors import ArgumentError
from tandem.parallel.ddp import DistributedDataParallel as DDP
from tandem.testing import spawn

pytestmark = pytest.mark.procs


def _catch(fn: Callable[[], Any]) -> dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"type": type(exc).__name__, "message": str(exc),
                "seconds": time.monotonic() - start, "trace": traceback.format_exc()}
    return {"type": None, "seconds": time.monotonic() - start}


class TwoLayers(nn.Module):
    def __init__(self, hidden: int = 8, extra: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(4, hidden)
        if extra:
            self.extra = nn.Linear(hidden, hidden)
        self.b = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor, skip_b: bool = False) -> torch.Tensor:
        h = self.a(x)
        return h.sum(1, keepdim=True) if skip_b else self.b(h)


def _mismatch_shape(rank: int) -> None:
    DDP(TwoLayers(hidden=8 if rank == 0 else 9))


def _mismatch_count(rank: int) -> None:
    DDP(TwoLayers(extra=rank == 1))


def _unused_everywhere(rank: int) -> None:
    ddp = DDP(TwoLayers())
    ddp(torch.randn(2, 4), skip_b=True).sum().backward()


def _separate_group(rank: int, world: int) -> Any:
    return tandem.new_group(list(range(world)))


def _unused_on_rank_1(rank: int, world: int) -> None:
    ddp = DDP(TwoLayers(), process_group=_separate_group(rank, world))
    ddp(torch.randn(2, 4), skip_b=rank == 1).sum().backward()


def _hook_twice(rank: int) -> None:
    ddp = DDP(TwoLayers())
    hook = lambda state, bucket: torch.futures.Future()  # noqa: E731 - never called
    ddp.register_comm_hook(None, hook)
    ddp.register_comm_hook(None, hook)


class SparseLookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 2, sparse=True)
        self.head = nn.Linear(2, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx))


def _sparse_left_out(rank: int) -> dict[str, Any]:
    """torch's way of keeping a sparse embedding out of DDP: the rest is reduced, the
    embedding's sparse gradient stays this rank's own."""
    model = SparseLookup()
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["emb.weight"])
    ddp = DDP(model)
    ddp(torch.tensor([rank, 5])).sum().backward()
    emb_grad = model.emb.weight.grad
    assert emb_grad is not None and emb_grad.is_sparse, emb_grad
    return {"head": model.head.weight.grad.tolist(),
            "rows": sorted(emb_grad.coalesce().indices()[0].tolist()),
            "local_head": model.emb(torch.tensor([rank, 5])).sum(0).tolist()}


def scenarios(rank: int, world: int) -> dict[str, dict[str, Any]]:
    # each scenario that leaves the default group aborted runs on a group of its own
    out = {
        "sparse_left_out": {"value": _sparse_left_out(rank)},
        "mismatch_shape": _catch(lambda: _mismatch_shape(rank)),
        "mismatch_count": _catch(lambda: _mismatch_count(rank)),
        "hook_twice": _catch(lambda: _hook_twice(rank)),
        "unused_on_rank_1": _catch(lambda: _unused_on_rank_1(rank, world)),
    }
    out["unused_everywhere"] = _catch(lambda: _unused_everywhere(rank))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, Any]]]:
    return spawn(2, scenarios, timeout=90, op_timeout=60)


@pytest.mark.timeout(120)
def test_different_parameter_shapes_raise_argument_error_naming_parameter_and_ranks(
        results: Any) -> None:
    for rank, r in enumerate(results):
        got = r["mismatch_shape"]
        assert got["type"] == "ArgumentError", f"rank {rank}: {got}"
        msg = got["message"]
        assert "'a.weight'" in msg and "[8, 4]" in msg and "[9, 4]" in msg, msg
        assert "rank(s) [0]" in msg and "rank(s) [1]" in msg, msg


@pytest.mark.timeout(120)
def test_different_parameter_lists_raise_argument_error_naming_the_first_difference(
        results: Any) -> None:
    for rank, r in enumerate(results):
        got = r["mismatch_count"]
        assert got["type"] == "ArgumentError", f"rank {rank}: {got}"
        assert "'extra.weight'" in got["message"] and "'b.weight'" in got["message"], got


@pytest.mark.timeout(120)
def test_unused_parameter_without_find_unused_raises_naming_it(results: Any) -> None:
    for rank, r in enumerate(results):
        got = r["unused_everywhere"]
        assert got["type"] == "StateError", f"rank {rank}: {got}"
        assert "'b.weight'" in got["message"] and "'b.bias'" in got["message"], got
        assert "find_unused_parameters=True" in got["message"], got
        assert got["seconds"] < 20, f"rank {rank} took {got['seconds']:.1f}s to fail"


@pytest.mark.timeout(120)
def test_parameter_unused_on_one_rank_fails_every_rank_without_hanging(results: Any) -> None:
    for rank, r in enumerate(results):
        got = r["unused_on_rank_1"]
        assert got["type"] == "StateError", f"rank {rank}: {got}"
        # rank 0 used 'b' and waits for rank 1's buckets: it gets rank 1's message
        assert "rank 1" in got["message"] and "'b.weight'" in got["message"], got
        assert got["seconds"] < 20, f"rank {rank} took {got['seconds']:.1f}s to fail"


@pytest.mark.timeout(120)
def test_registering_a_second_comm_hook_is_refused(results: Any) -> None:
    for rank, r in enumerate(results):
        assert r["hook_twice"]["type"] == "StateError", f"rank {rank}: {r['hook_twice']}"


@pytest.mark.timeout(120)
def test_a_sparse_embedding_left_out_with_torchs_ignore_list_keeps_its_own_gradient(
        results: Any) -> None:
    values = [r["sparse_left_out"]["value"] for r in results]
    for rank, v in enumerate(values):
        assert v["rows"] == [rank, 5], f"rank {rank}: the embedding's gradient was {v}"
    # the head's gradient is the average of the ranks' own (the same weights everywhere
    # after the sync at construction, so each rank's local gradient is its input's sum)
    expected = [(a + b) / 2 for a, b in zip(values[0]["local_head"], values[1]["local_head"])]
    for rank, v in enumerate(values):
        assert v["head"] == [pytest.approx(expected, abs=1e-6)], f"rank {rank}: {v}"


def test_a_sparse_gradient_is_refused_naming_the_embedding_and_the_way_out() -> None:
    for module in (nn.Embedding(4, 2, sparse=True), nn.Sequential(
            nn.EmbeddingBag(4, 2, sparse=True), nn.Linear(2, 1))):
        with pytest.raises(ArgumentError) as info:
            DDP(module)
        msg = str(info.value)
        assert "sparse=True" in msg and "_set_params_and_buffers_to_ignore_for_model" in msg, msg
    frozen = nn.Sequential(nn.Embedding(4, 2, sparse=True).requires_grad_(False))
    with pytest.raises(Exception) as info:  # no group here: the refusal comes first or never
        DDP(frozen)
    assert "sparse" not in str(info.value), "a frozen table gets no gradient, sparse or not"


def test_device_ids_are_refused_for_cpu_modules() -> None:
    with pytest.raises(ArgumentError, match="device_ids"):
        DDP(nn.Linear(2, 2), device_ids=[0])


def test_bucket_cap_must_be_positive() -> None:
    with pytest.raises(ArgumentError, match="bucket_cap_mb"):
        DDP(nn.Linear(2, 2), bucket_cap_mb=0)
