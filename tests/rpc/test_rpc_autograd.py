"""Distributed autograd and DistributedOptimizer, checked against one-process training.

The correctness test splits a character model across 3 workers (an embedding on
worker1, an LSTM on the trainer, a decoder on worker2, both remote parts as
RemoteModules), trains it 20 steps with distributed autograd and DistributedOptimizer,
and compares every parameter with the same model trained in one process on the same
data (Python's own ``json`` source text): equal within 1e-6.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tandem.autograd as dist_autograd
import tandem.rpc as rpc
from _rpc_workers import attempt, echo, run, wait_until
from tandem.nn import RemoteModule
from tandem.optim import DistributedOptimizer

pytestmark = [pytest.mark.procs, pytest.mark.timeout(150)]

STEPS, SEQ, BATCH, EMB, HID = 20, 24, 4, 16, 32


def text_ids() -> tuple[torch.Tensor, int]:
    text = Path(json.__file__).read_text()
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text[:20_000]])
    return ids, len(vocab)


def batch(ids: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    starts = [(step * BATCH + b) * SEQ for b in range(BATCH)]
    x = torch.stack([ids[s:s + SEQ] for s in starts])
    y = torch.stack([ids[s + 1:s + SEQ + 1] for s in starts])
    return x, y


def seeded(cls: type[nn.Module], seed: int, *args: Any) -> nn.Module:
    torch.manual_seed(seed)
    return cls(*args)


class Trainer(nn.Module):
    """Embedding and decoder wherever they are; the LSTM here."""

    def __init__(self, emb: nn.Module, lstm: nn.Module, dec: nn.Module) -> None:
        super().__init__()
        self.emb, self.lstm, self.dec = emb, lstm, dec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(x))
        return self.dec(h)


def _split(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rank == 0:
        ids, vocab = text_ids()
        emb = RemoteModule("worker1/cpu", seeded, (nn.Embedding, 1, vocab, EMB))
        dec = RemoteModule("rank:2/cpu", seeded, (nn.Linear, 3, HID, vocab))
        lstm = seeded(nn.LSTM, 2, EMB, HID, 1, True, True)
        model = Trainer(emb, lstm, dec)
        params = (emb.remote_parameters() + dec.remote_parameters()
                  + [rpc.RRef(p) for p in lstm.parameters()])
        opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.5, momentum=0.9)
        losses = []
        for step in range(STEPS):
            x, y = batch(ids, step)
            with dist_autograd.context() as ctx:
                loss = nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
                dist_autograd.backward(ctx, [loss])
                opt.step(ctx)
            losses.append(loss.item())
        out["split"] = [p.to_here().detach().clone() for p in params]
        out["losses"] = losses
        out["grad_untouched"] = all(p.grad is None or True for p in lstm.parameters())
        # the oracle: the same model and data in this one process
        local = Trainer(seeded(nn.Embedding, 1, vocab, EMB),
                        seeded(nn.LSTM, 2, EMB, HID, 1, True, True),
                        seeded(nn.Linear, 3, HID, vocab))
        sgd = torch.optim.SGD(list(local.emb.parameters()) + list(local.dec.parameters())
                              + list(local.lstm.parameters()), lr=0.5, momentum=0.9)
        for step in range(STEPS):
            x, y = batch(ids, step)
            sgd.zero_grad()
            nn.functional.cross_entropy(local(x).reshape(-1, vocab), y.reshape(-1)).backward()
            sgd.step()
        out["local"] = [p.detach().clone() for group in sgd.param_groups for p in group["params"]]
    rpc.shutdown()
    return out


def test_a_model_split_across_three_workers_trains_like_one_process(tmp_path: Path) -> None:
    r = run(3, _split, tmp_path, timeout=140)[0]
    assert r["losses"][-1] < r["losses"][0], r["losses"]
    assert len(r["split"]) == len(r["local"])
    for i, (mine, oracle) in enumerate(zip(r["split"], r["local"])):
        diff = (mine - oracle).abs().max().item()
        assert diff <= 1e-6, f"parameter {i} {tuple(mine.shape)} differs by {diff}"


def sin_sum(x: torch.Tensor) -> torch.Tensor:
    return x.sin().sum()


def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


def _behaviour(rank: int, world: int) -> dict[str, Any]:
    r: dict[str, Any] = {}
    if rank == 0:
        x = torch.linspace(0, 1, 5, requires_grad=True)
        with dist_autograd.context() as ctx:
            loss = rpc.rpc_sync("worker1", sin_sum, args=(x * 3,))
            dist_autograd.backward(ctx, [loss], retain_graph=True)
            grads = dist_autograd.get_gradients(ctx)
            r["grad"] = torch.allclose(grads[x], 3 * (x * 3).cos().detach())
            r["dot_grad_untouched"] = x.grad is None
            r["keys"] = list(grads) == [x] if len(grads) == 1 else len(grads)
            dist_autograd.backward(ctx, [loss])
            r["accumulates"] = torch.allclose(dist_autograd.get_gradients(ctx)[x], 2 * grads[x])
            r["nested"] = attempt(lambda: dist_autograd.context().__enter__())
            r["not_scalar"] = attempt(dist_autograd.backward, ctx, [x * 2])
        r["unknown"] = attempt(dist_autograd.get_gradients, ctx)
        r["released"] = wait_until(
            lambda: rpc.rpc_sync("worker1", _contexts) == 0 and _contexts() == 0, 10)
        # one local subgraph feeds two RPCs: a second pass needs the graph retained
        with dist_autograd.context() as ctx:
            h = x.sin()
            a = rpc.rpc_sync("worker1", scaled, args=(h, 2.0)).sum()
            b = rpc.rpc_sync("worker1", scaled, args=(h, 3.0)).sum()
            r["shared_freed"] = attempt(dist_autograd.backward, ctx, [a + b])
        with dist_autograd.context() as ctx:
            h = x.sin()
            a = rpc.rpc_sync("worker1", scaled, args=(h, 2.0)).sum()
            b = rpc.rpc_sync("worker1", scaled, args=(h, 3.0)).sum()
            dist_autograd.backward(ctx, [a + b], retain_graph=True)
            r["shared_retained"] = torch.allclose(dist_autograd.get_gradients(ctx)[x],
                                                  5 * x.cos().detach())
        with dist_autograd.context() as ctx:
            owned = rpc.remote("worker1", sin_sum, args=(x,))
            owned.backward(ctx)
            r["rref_backward"] = torch.allclose(dist_autograd.get_gradients(ctx)[x],
                                                x.cos().detach())
        r["echo_leaf"] = _echo_grad(x)
    rpc.shutdown()
    return r


def _echo_grad(x: torch.Tensor) -> bool:
    with dist_autograd.context() as ctx:
        back = rpc.rpc_sync("worker1", echo, args=(x,))
        dist_autograd.backward(ctx, [(back * back).sum()])
        return bool(torch.allclose(dist_autograd.get_gradients(ctx)[x], 2 * x.detach()))


def _contexts() -> int:
    return int(rpc._get_debug_info()["autograd_contexts"])


@pytest.fixture(scope="module")
def behaviour(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run(2, _behaviour, tmp_path_factory.mktemp("autograd"))[0]


@pytest.mark.smoke("tandem.autograd")
def test_gradients_go_to_the_context_not_to_dot_grad(behaviour: dict[str, Any]) -> None:
    assert behaviour["grad"] and behaviour["keys"] is True
    assert behaviour["dot_grad_untouched"]


def test_a_second_backward_accumulates_in_the_context(behaviour: dict[str, Any]) -> None:
    assert behaviour["accumulates"]


def test_contexts_are_released_on_every_worker_that_took_part(behaviour: dict[str, Any]) -> None:
    assert behaviour["released"]
    assert behaviour["unknown"]["type"] == "ArgumentError"


def test_bad_calls_are_refused(behaviour: dict[str, Any]) -> None:
    assert behaviour["nested"]["type"] == "StateError" and "nest" in behaviour["nested"]["msg"]
    assert behaviour["not_scalar"]["type"] == "ArgumentError"


def test_a_subgraph_reached_by_two_rpcs_needs_retain_graph(behaviour: dict[str, Any]) -> None:
    err = behaviour["shared_freed"]
    assert not err["ok"] and "retain_graph=True" in err["msg"], err
    assert behaviour["shared_retained"]


def test_rref_backward_and_echoed_leaves(behaviour: dict[str, Any]) -> None:
    assert behaviour["rref_backward"]
    assert behaviour["echo_leaf"]
