"""DataParallel and its helpers against the plain module on the full batch.

CPU replicas run in threads (``device_ids=["cpu", ...]``); outputs and the gradients
summed into the original parameters must equal those of the plain module on the
whole batch. BatchNorm in training mode normalises each chunk by itself, so there
the oracle is the plain module applied chunk by chunk. Accelerator tests skip with
the reason on machines without one.

Run: ``python -m pytest tests/parallel/test_data_parallel.py -q``.
"""

from __future__ import annotations

import collections
import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tandem.errors import ArgumentError
from tandem.parallel import DataParallel, data_parallel, gather, parallel_apply, replicate, scatter

CPU3 = ["cpu", "cpu", "cpu"]
Pair = collections.namedtuple("Pair", "logits hidden")


class Net(nn.Module):
    """Keyword inputs (a tensor to scatter, a number to copy) and structured outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
        self.threads: set[str] = set()

    def forward(self, x: torch.Tensor, *, bias: torch.Tensor | None = None,
                scale: float = 1.0) -> dict[str, Any]:
        self.threads.add(threading.current_thread().name)
        h = torch.tanh(self.fc(x))
        if bias is not None:
            h = h + bias
        return {"out": Pair(self.head(h) * scale, h), "nothing": None}


def _grads(m: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in m.parameters()]  # type: ignore[union-attr]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("devices,rows", [(["cpu", "cpu"], 8), (CPU3, 10), (CPU3, 2)],
                         ids=["2x8", "3x10", "3x2-fewer-rows"])
def test_outputs_and_gradients_equal_the_plain_module_on_the_full_batch(
        devices: list[str], rows: int) -> None:
    torch.manual_seed(0)
    net = Net()
    plain = copy.deepcopy(net)
    x, bias = torch.randn(rows, 6), torch.randn(rows, 8)
    dp = DataParallel(net, device_ids=devices)
    ours = dp(x, bias=bias, scale=2.0)
    theirs = plain(x, bias=bias, scale=2.0)
    assert ours["nothing"] is None and isinstance(ours["out"], Pair)
    _close(list(ours["out"]), list(theirs["out"]))
    (ours["out"].logits ** 2).sum().backward()
    (theirs["out"].logits ** 2).sum().backward()
    _close(_grads(net), _grads(plain))
    assert dp.module is net
    assert len(net.threads) == min(rows, len(devices)), "replicas did not run in threads"


def test_dim_splits_another_dimension() -> None:
    torch.manual_seed(1)
    rnn = nn.GRU(5, 7)  # (time, batch, features): the batch is dim 1
    plain = copy.deepcopy(rnn)
    x = torch.randn(4, 6, 5)
    out, h = DataParallel(rnn, device_ids=CPU3, dim=1)(x)
    ref, ref_h = plain(x)
    _close([out], [ref])
    out.sum().backward()
    ref.sum().backward()
    _close(_grads(rnn), _grads(plain))


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.fc(x)))


def test_batchnorm_in_eval_mode_equals_the_full_batch() -> None:
    torch.manual_seed(2)
    net = WithBatchNorm()
    with torch.no_grad():
        net.bn.running_mean.uniform_(-1, 1)
        net.bn.running_var.uniform_(0.5, 2)
    plain = copy.deepcopy(net)
    net.eval()
    plain.eval()
    x = torch.randn(9, 6)
    out = DataParallel(net, device_ids=CPU3)(x)
    ref = plain(x)
    _close([out], [ref])
    out.sum().backward()
    ref.sum().backward()
    _close(_grads(net), _grads(plain))


def test_batchnorm_in_training_mode_normalises_each_chunk_and_keeps_the_first_ones_stats() -> None:
    torch.manual_seed(3)
    net = WithBatchNorm()
    per_chunk = copy.deepcopy(net)  # the oracle: the plain module on each chunk
    first = copy.deepcopy(net)  # sees the first chunk only
    x = torch.randn(9, 6)
    out = DataParallel(net, device_ids=CPU3)(x)
    _close([out], [torch.cat([per_chunk(c) for c in x.chunk(3)])])
    first(x.chunk(3)[0])
    _close([net.bn.running_mean, net.bn.running_var],
           [first.bn.running_mean, first.bn.running_var])
    assert int(net.bn.num_batches_tracked) == 1


def test_without_an_accelerator_device_ids_none_runs_the_module_directly() -> None:
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator: device_ids=None uses it")
    net = Net()
    dp = DataParallel(net)
    assert dp.device_ids == []
    x = torch.randn(4, 6)
    torch.testing.assert_close(dp(x)["out"].logits, net(x)["out"].logits)
    assert len(net.threads) == 1


def test_data_parallel_function_with_keyword_inputs() -> None:
    torch.manual_seed(4)
    net = Net()
    x, bias = torch.randn(5, 6), torch.randn(5, 8)
    out = data_parallel(net, x, ["cpu", "cpu"], module_kwargs={"bias": bias})
    _close([out["out"].hidden], [net(x, bias=bias)["out"].hidden])


def test_scatter_cuts_tensors_and_copies_everything_else() -> None:
    x = torch.arange(10.0).reshape(5, 2)
    parts = scatter((x, {"m": x[:, 0], "k": "name"}, [7]), CPU3)
    assert len(parts) == 3
    assert [p[0].shape[0] for p in parts] == [2, 2, 1]
    assert all(p[1]["k"] == "name" and p[2] == [7] for p in parts)
    torch.testing.assert_close(torch.cat([p[1]["m"] for p in parts]), x[:, 0])


def test_gather_of_scalars_warns_and_returns_one_value_per_replica() -> None:
    with pytest.warns(UserWarning, match="scalars"):
        out = gather([torch.tensor(1.0), torch.tensor(2.0)], "cpu")
    assert out.tolist() == [1.0, 2.0]


def test_replicas_share_the_first_ones_buffers_and_keep_tied_weights_tied() -> None:
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    tied = nn.Sequential(net, nn.Linear(3, 3))
    tied[1].weight = net[0].weight
    first, second = replicate(tied, ["cpu", "cpu"])
    assert first[0][1].running_mean is net[1].running_mean
    assert second[0][1].running_mean is not net[1].running_mean
    assert first[0][0].weight is first[1].weight, "tied weights came apart"
    assert first[0][0].weight.grad_fn is not None, "a replica's weight is not a copy of the original"
    detached, = replicate(tied, ["cpu"], detach=True)
    assert detached[0][0].weight.grad_fn is None and not detached[0][0].weight.requires_grad


def test_parallel_apply_keeps_grad_mode_and_names_the_failing_replica() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("bad input")

    lin = nn.Linear(2, 2)
    with torch.no_grad():
        outs = parallel_apply([lin, lin], [torch.ones(1, 2), (torch.ones(1, 2),)])
    assert all(o.grad_fn is None for o in outs)
    with pytest.raises(ValueError, match="bad input") as info:
        parallel_apply([lin, Fails()], [torch.ones(1, 2), torch.ones(1, 2)])
    assert any("replica 1" in note for note in getattr(info.value, "__notes__", ["replica 1"]))


def test_bad_device_lists_are_refused() -> None:
    if not torch.accelerator.is_available():
        with pytest.raises(ArgumentError, match="no accelerator"):
            DataParallel(Net(), device_ids=[0, 1])
        with pytest.raises(ArgumentError, match="output_device"):
            DataParallel(Net(), output_device="cpu")
    with pytest.raises(ArgumentError, match="list of devices"):
        DataParallel(Net(), device_ids="cpu")  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="nn.Module"):
        DataParallel(lambda x: x)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.accelerator.is_available() or torch.accelerator.device_count() < 2,
                    reason="needs two accelerator devices (CUDA, XPU...); this machine has "
                           "fewer")
def test_accelerator_replicas_match_the_plain_module() -> None:
    torch.manual_seed(5)
    device = torch.accelerator.current_accelerator()
    assert device is not None
    net = Net().to(torch.device(device.type, 0))
    plain = copy.deepcopy(net)
    x = torch.randn(8, 6, device=net.fc.weight.device)
    out = DataParallel(net)(x)["out"].logits
    ref = plain(x)["out"].logits
    _close([out], [ref])
    out.sum().backward()
    ref.sum().backward()
    _close(_grads(net), _grads(plain))


def test_more_device_ids_than_replicas_a_forward_may_run_are_refused() -> None:
    # 10**6 'cpu' entries were taken: as many replicas and threads at the first forward
    from tandem.parallel.data_parallel import MAX_REPLICAS

    with pytest.raises(ArgumentError, match=r"len\(device_ids\)=1025 is above its limit of 1024"):
        DataParallel(nn.Linear(2, 2), device_ids=["cpu"] * (MAX_REPLICAS + 1))
    assert len(DataParallel(nn.Linear(2, 2), device_ids=["cpu"] * 4).device_ids) == 4


@pytest.mark.parametrize("dim", ["a", 1.0, True, None])
def test_a_dim_that_is_not_an_int_is_refused_at_construction(dim: Any) -> None:
    with pytest.raises(ArgumentError, match="DataParallel: dim must be an int"):
        DataParallel(nn.Linear(2, 2), device_ids=["cpu", "cpu"], dim=dim)
