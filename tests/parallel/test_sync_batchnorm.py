"""SyncBatchNorm equals nn.BatchNorm on the concatenated batch, across ranks of unequal batches."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn

import tandem.parallel.sync_batchnorm as sbn
from tandem.errors import ArgumentError
from tandem.parallel.sync_batchnorm import SyncBatchNorm
from tandem.testing import launch, spawn

# (batch-norm class, shape of one sample: channels first)
LAYERS: list[tuple[type[nn.Module], tuple[int, ...]]] = [
    (nn.BatchNorm1d, (3,)),
    (nn.BatchNorm1d, (3, 5)),
    (nn.BatchNorm2d, (4, 3, 2)),
    (nn.BatchNorm3d, (2, 2, 3, 2)),
]
STEPS = 2  # two training steps, so running statistics accumulate through the momentum


def _data(sizes: tuple[int, ...], sample: tuple[int, ...], step: int) -> tuple[torch.Tensor, ...]:
    """The global batch and the upstream gradient of one step, the same on every rank."""
    gen = torch.Generator().manual_seed(100 + step)
    n = sum(sizes)
    x = torch.randn((n, *sample), generator=gen, dtype=torch.float64) * 3 + 2
    grad = torch.randn((n, *sample), generator=gen, dtype=torch.float64)
    return x, grad


def _reference(kind: type[nn.Module], sample: tuple[int, ...], sizes: tuple[int, ...],
               momentum: float | None) -> dict[str, Any]:
    """Single-process nn.BatchNorm on the concatenated batch."""
    bn = kind(sample[0], momentum=momentum, dtype=torch.float64)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
        bn.bias.uniform_(-1, 1, generator=torch.Generator().manual_seed(2))
    out: dict[str, Any] = {"y": [], "dx": [], "dw": [], "db": []}
    for step in range(STEPS):
        x, grad = _data(sizes, sample, step)
        x.requires_grad_(True)
        bn.zero_grad()
        y = bn(x)
        y.backward(grad)
        out["y"].append(y.detach())
        out["dx"].append(x.grad)
        out["dw"].append(bn.weight.grad.clone())
        out["db"].append(bn.bias.grad.clone())
    out["running"] = (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
    bn.eval()
    out["eval"] = bn(_data(sizes, sample, STEPS)[0]).detach()
    return out


def _portable(obj: Any) -> Any:
    """Tensors as bytes: tandem.testing's result queue cannot carry torch tensors out of a
    child (torch's fd-sharing pickler fails once the child has exited)."""
    if isinstance(obj, torch.Tensor):
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_portable(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    return obj


def _restore(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return torch.load(io.BytesIO(obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_restore(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _restore(v) for k, v in obj.items()}
    return obj


def _rank_run(rank: int, world_size: int, sizes: tuple[int, ...],
              momentum: float | None) -> Any:
    start = sum(sizes[:rank])
    mine = slice(start, start + sizes[rank])
    results = []
    for kind, sample in LAYERS:
        bn = SyncBatchNorm.convert_sync_batchnorm(kind(sample[0], momentum=momentum,
                                                       dtype=torch.float64))
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
            bn.bias.uniform_(-1, 1, generator=torch.Generator().manual_seed(2))
        out: dict[str, Any] = {"y": [], "dx": [], "dw": [], "db": []}
        for step in range(STEPS):
            x, grad = _data(sizes, sample, step)
            x = x[mine].clone().requires_grad_(True)
            bn.zero_grad()
            y = bn(x)
            y.backward(grad[mine])
            out["y"].append(y.detach())
            out["dx"].append(x.grad)
            out["dw"].append(bn.weight.grad.clone())
            out["db"].append(bn.bias.grad.clone())
        out["running"] = (bn.running_mean.clone(), bn.running_var.clone(),
                          int(bn.num_batches_tracked))
        bn.eval()

        def no_communication(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("SyncBatchNorm communicated in eval mode")

        real = sbn.all_reduce
        setattr(sbn, "all_reduce", no_communication)
        try:
            out["eval"] = bn(_data(sizes, sample, STEPS)[0][mine]).detach()
        finally:
            setattr(sbn, "all_reduce", real)
        results.append(out)
    return _portable(results)


@pytest.mark.procs
@pytest.mark.parametrize("sizes,momentum", [((3, 5), 0.1), ((4, 1, 6), None), ((0, 6), 0.3)],
                         ids=["2-ranks", "3-ranks-cumulative", "2-ranks-one-empty"])
def test_matches_batchnorm_on_the_concatenated_batch(sizes: tuple[int, ...],
                                                     momentum: float | None) -> None:
    per_rank = _restore(spawn(len(sizes), _rank_run, (sizes, momentum), timeout=90))
    for i, (kind, sample) in enumerate(LAYERS):
        ref = _reference(kind, sample, sizes, momentum)
        got = [per_rank[r][i] for r in range(len(sizes))]
        what = f"{kind.__name__} sample {sample}"
        for step in range(STEPS):
            y = torch.cat([g["y"][step] for g in got])
            torch.testing.assert_close(y, ref["y"][step], msg=f"{what}: output, step {step}")
            dx = torch.cat([g["dx"][step] for g in got])
            torch.testing.assert_close(dx, ref["dx"][step],
                                       msg=f"{what}: input gradient, step {step}")
            # weight/bias gradients are local; DDP's all-reduce adds them up
            dw = torch.stack([g["dw"][step] for g in got]).sum(0)
            db = torch.stack([g["db"][step] for g in got]).sum(0)
            torch.testing.assert_close(dw, ref["dw"][step], msg=f"{what}: weight grad, step {step}")
            torch.testing.assert_close(db, ref["db"][step], msg=f"{what}: bias grad, step {step}")
        for r, g in enumerate(got):
            torch.testing.assert_close(g["running"][0], ref["running"][0],
                                       msg=f"{what}: running_mean on rank {r}")
            torch.testing.assert_close(g["running"][1], ref["running"][1],
                                       msg=f"{what}: running_var on rank {r}")
            assert g["running"][2] == ref["running"][2]
        torch.testing.assert_close(torch.cat([g["eval"] for g in got]), ref["eval"],
                                   msg=f"{what}: eval output")


def _float32_run(rank: int, world_size: int) -> Any:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 4, 6, generator=gen) * 0.1 + 1000.0  # large mean, small spread
    bn = SyncBatchNorm(4)
    return _portable(bn(x[rank * 4:(rank + 1) * 4]).detach())


@pytest.mark.procs
def test_float32_statistics_survive_a_large_mean() -> None:
    got = torch.cat(_restore(spawn(2, _float32_run, timeout=60)))
    x = torch.randn(8, 4, 6, generator=torch.Generator().manual_seed(5)) * 0.1 + 1000.0
    torch.testing.assert_close(got, nn.BatchNorm1d(4)(x).detach(), atol=2e-3, rtol=1e-3)


def _single_value_run(rank: int, world_size: int) -> None:
    SyncBatchNorm(3)(torch.randn(1 - rank, 3))


@pytest.mark.procs
def test_one_value_per_channel_fails_on_every_rank() -> None:
    outcomes = launch(2, _single_value_run, timeout=60)
    for o in outcomes:
        assert not o.ok and o.error_type == "ArgumentError", (o.rank, o.error)
        assert "more than 1 value per channel" in o.error


def test_without_a_process_group_it_is_plain_batchnorm() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 3, 4)
    torch.testing.assert_close(SyncBatchNorm(3)(x), nn.BatchNorm1d(3)(x))


def test_convert_replaces_every_batchnorm_and_keeps_its_state() -> None:
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4),
                          nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False)))
    model[1].running_mean.fill_(0.5)
    model[1].num_batches_tracked.fill_(7)
    weight = model[1].weight
    model.eval()
    converted = SyncBatchNorm.convert_sync_batchnorm(model)
    bn2d, bn1d = converted[1], converted[2][1]
    assert isinstance(bn2d, SyncBatchNorm) and isinstance(bn1d, SyncBatchNorm)
    assert isinstance(converted[0], nn.Conv2d) and isinstance(converted[2][0], nn.Linear)
    assert bn2d.weight is weight
    assert bn1d.weight is None and not bn1d.affine
    assert torch.equal(bn2d.running_mean, torch.full((4,), 0.5))
    assert int(bn2d.num_batches_tracked) == 7
    assert not bn2d.training and not bn1d.training


@pytest.mark.parametrize("group", ["gloo", 0, object()])
def test_a_process_group_that_is_not_a_tandem_group_is_refused_at_construction(
        group: Any) -> None:
    # it was kept, and failed only in the first forward of a job that had started
    with pytest.raises(ArgumentError, match="SyncBatchNorm: process_group must be"):
        SyncBatchNorm(4, process_group=group)
    with pytest.raises(ArgumentError, match="SyncBatchNorm: process_group must be"):
        SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(4)), group)


def test_input_of_fewer_than_two_dimensions_is_an_argument_error() -> None:
    with pytest.raises(ArgumentError, match="at least 2D"):
        SyncBatchNorm(3)(torch.randn(3))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 6), nn.BatchNorm1d(6)).double()


def _ddp_run(rank: int, world_size: int, sizes: tuple[int, ...]) -> Any:
    from tandem.parallel import DistributedDataParallel

    model = DistributedDataParallel(SyncBatchNorm.convert_sync_batchnorm(_net()))
    start = sum(sizes[:rank])
    grads = []
    for step in range(2):
        x, g = _data(sizes, (2, 6, 6), step)
        x, g = x[start:start + sizes[rank]], g[start:start + sizes[rank], :1, 0, :].reshape(-1, 6)
        model.zero_grad()
        # DDP averages gradients; scaling by world_size turns the average into the sum
        (model(x) * g).sum().mul(world_size).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return _portable([grads, [b.clone() for b in model.module.buffers()]])


@pytest.mark.procs
def test_inside_ddp_gradients_match_one_process_on_the_whole_batch() -> None:
    sizes = (3, 5)
    per_rank = _restore(spawn(2, _ddp_run, (sizes,), timeout=90))
    net = _net()
    for step in range(2):
        x, g = _data(sizes, (2, 6, 6), step)
        net.zero_grad()
        (net(x) * g[:, :1, 0, :].reshape(-1, 6)).sum().backward()
        for r, (grads, _) in enumerate(per_rank):
            for (name, p), got in zip(net.named_parameters(), grads[step]):
                torch.testing.assert_close(got, p.grad, msg=f"rank {r} step {step}: {name}.grad")
    for r, (_, buffers) in enumerate(per_rank):
        for (name, b), got in zip(net.named_buffers(), buffers):
            torch.testing.assert_close(got, b, msg=f"rank {r}: buffer {name}")
