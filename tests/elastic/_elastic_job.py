"""A small elastic training job for the tests, and its oracle.

``job(rank, world_size, spec)`` runs in each process that ``tandem.testing.launch``
starts (``init=False``): it joins the process group (or, as a joiner, makes a world
of its own), trains a small MLP with DDP and AdamW on a fixed regression set through
``run_elastic``, committing every step, and returns its parameters and the history of
the steps it applied: ``(step, world size, sample position)`` per step, rolled back
with the state, so it is exactly the membership schedule the final parameters went
through. ``oracle(history)`` trains the same model in one process along that
schedule: each step's gradient is the average of the per-rank gradients of the
batches the sampler assigns.

The victim rank SIGKILLs itself at ``kill_step`` in its first life, ``where``:
``backward`` (in a gradient hook, before its gradients are reduced; ``stop``: there,
it SIGSTOPs itself instead), ``allreduce``
(in a DDP comm hook, 5 ms after its bucket's all-reduce was issued) or ``optimizer``
(in the optimizer's step pre-hook, after the gradients were reduced).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tandem
from tandem.collectives.world import world
from tandem.elastic import ElasticSampler, ElasticState, run_elastic
from tandem.elastic.roster import Roster
from tandem.parallel import DistributedDataParallel
from tandem.parallel.comm_hooks import allreduce_hook
from tandem.store.tcp import TCPStore

N, DIM, BATCH, SEED = 96, 8, 4, 1
PREFIX = "tandem/elastic"


@dataclasses.dataclass(frozen=True)
class Spec:
    steps: int
    members: int  # ranks that start as members; launch ranks >= members are joiners
    pg_url: str  # file:// rendezvous of the initial members
    store_port: int  # the test's TCPStore: elastic store and test signals
    backend: str = "auto"
    victim: int = -1
    kill_step: int = -1
    where: str = "backward"
    rejoin_step: int = -1  # members wait here until the joiner is queued
    spare_step: int = -1  # members wait here until a joiner is queued, whatever the size
    hook: bool = False  # run DDP with the all-reduce comm hook (always for "allreduce")
    victim2: int = -1  # a second victim (by launch rank), killed at its kill_step2
    kill_step2: int = -1  # before its commit (after the step was applied everywhere)
    max_ranks: int = 0  # TANDEM_ELASTIC_MAX_RANKS (joiners beyond it wait as spares)
    min_ranks: int = 1
    op_timeout: float = 30.0  # the collectives' timeout
    hosts: tuple[str, ...] = ()  # TANDEM_HOST_ID by launch rank: simulated hosts
    # (rank, other): on a failure, rank goes on to recover only once other arrived at the
    # round or left the group, so other judges the failure before anyone arrived
    hold: tuple[int, int] = (-1, -1)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, DIM, generator=g)
    return x, (x[:, :1] * 2 - x[:, 1:2]).tanh() + 0.1 * torch.randn(N, 1, generator=g)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 1))


def optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(net.parameters(), lr=0.05)


def _kill(why: str) -> None:
    print(f"victim {os.getpid()}: SIGKILL {why}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _store(spec: Spec) -> TCPStore:
    return TCPStore("127.0.0.1", spec.store_port, is_master=False, wait_for_workers=False,
                    timeout=60)


def job(rank: int, world_size: int, spec: Spec) -> dict[str, Any]:
    joiner = rank >= spec.members
    os.environ["TANDEM_ELASTIC_STORE"] = f"tcp://127.0.0.1:{spec.store_port}?prefix={PREFIX}"
    os.environ["TANDEM_ELASTIC_ID"] = f"w{rank}"
    os.environ["TANDEM_ELASTIC_MAX_RANKS"] = str(spec.max_ranks)
    signals = _store(spec)
    if spec.hosts:
        os.environ["TANDEM_HOST_ID"] = spec.hosts[rank]
    if joiner:
        os.environ["TANDEM_ELASTIC_JOIN"] = "1"
        tandem.init_process_group(spec.backend, store=tandem.HashStore(), rank=0, world_size=1,
                                  timeout=30)
        if spec.rejoin_step >= 0:  # join when the members wait for it
            signals.wait(["test/join-now"], 60)
    else:
        tandem.init_process_group(spec.backend, init_method=spec.pg_url, rank=rank,
                                  world_size=spec.members, timeout=spec.op_timeout)
    x, y = data()
    net = model()
    ddp = DistributedDataParallel(net)
    opt = optimizer(net)
    victim = rank == spec.victim and not joiner
    if spec.hook or spec.where == "allreduce":
        ddp.register_comm_hook(None, killing_hook if victim else allreduce_hook)
    state = ElasticState(model=ddp, optimizer=opt, step=0, history=[], min_ranks=spec.min_ranks)
    sampler = ElasticSampler(N, state, BATCH, seed=SEED)
    if victim:
        arm_kill(spec.kill_step, spec.where, net, opt, state)

    @run_elastic(state)
    def train(state: ElasticState) -> None:
        for idx in sampler:
            if state.step >= spec.steps:
                return
            loss = F.mse_loss(ddp(x[idx]), y[idx])
            opt.zero_grad()
            try:
                loss.backward()
            except Exception:
                if rank == spec.hold[0]:
                    _await_judged(signals, spec.hold[1])
                raise
            opt.step()
            state.history.append((state.step, state.world_size, sampler.position_at(state.step)))
            state.step += 1
            if state.step == spec.rejoin_step and state.world_size < spec.members:
                _await_joiner(signals)  # so that this commit lets it in
            if state.step == spec.spare_step:
                _await_joiner(signals)  # a spare, ready before anyone dies
            if rank == spec.victim2 and state.step == spec.kill_step2:
                _kill("before its commit")
            state.commit()

    train()
    signals.close()
    return {"params": [p.detach().clone() for p in net.parameters()],
            "history": list(state.history), "rank": tandem.get_rank(),
            "world_size": tandem.get_world_size(), "pid": os.getpid(), "joiner": joiner}


def _await_judged(signals: TCPStore, other: int) -> None:
    """Until launch rank ``other`` arrived at the round of generation 0 (it judged the
    failure recoverable) or left the group (it judged it fatal)."""
    roster = Roster(signals, PREFIX)
    transport = world().transport
    deadline = time.monotonic() + 60
    while (not roster.arrived(0, [f"w{other}"]) and other not in transport.left_peers()
           and other not in transport.lost_peers() and time.monotonic() < deadline):
        time.sleep(0.01)


def _await_joiner(signals: TCPStore) -> None:
    signals.set("test/join-now", b"1")
    roster = Roster(signals, PREFIX)
    deadline = time.monotonic() + 60
    while not roster.joiners() and time.monotonic() < deadline:
        time.sleep(0.01)


_armed: dict[str, Any] = {}


def _stop() -> None:
    print(f"victim {os.getpid()}: SIGSTOP in backward", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # stuck for good: nothing here resumes it


def arm_kill(step: int, where: str, net: nn.Module, opt: torch.optim.Optimizer,
             state: ElasticState) -> None:
    """SIGKILL this process at ``state.step == step``, ``where`` (see the module
    docstring; ``allreduce`` also needs :func:`killing_hook` as DDP's comm hook)."""
    _armed.update(step=step, where=where, state=state)
    if where in ("backward", "stop"):
        first = next(net.parameters())  # the first layer's weight: its gradient comes last
        first.register_hook(lambda g: (_stop() if where == "stop" else _kill("in backward"))
                            if _due() else None)
    elif where == "optimizer":
        opt.register_step_pre_hook(lambda *_: _kill("in the optimizer step") if _due() else None)


def _due() -> bool:
    return bool(_armed) and _armed["state"].step == _armed["step"]


def killing_hook(state: object, bucket: Any) -> torch.futures.Future[Any]:
    fut = allreduce_hook(state, bucket)
    if _due() and _armed["where"] == "allreduce":
        time.sleep(0.005)
        _kill("during the gradient all-reduce")
    return fut


def batch(position: int, rank: int, world_size: int) -> list[int]:
    """The sampler's indices, computed afresh: epoch e is randperm(N, seed + e)."""
    out = []
    for p in range(position + rank * BATCH, position + (rank + 1) * BATCH):
        epoch, offset = divmod(p, N)
        order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch))
        out.append(int(order[offset]))
    return out


def oracle(history: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """Train in one process along ``history``'s membership schedule; the parameters."""
    x, y = data()
    net = model()
    opt = optimizer(net)
    for _, world, position in history:
        grads = [torch.zeros_like(p) for p in net.parameters()]
        for r in range(world):
            idx = batch(position, r, world)
            net.zero_grad()
            F.mse_loss(net(x[idx]), y[idx]).backward()
            for g, p in zip(grads, net.parameters()):
                g += p.grad / world
        for g, p in zip(grads, net.parameters()):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def check_against_oracle(results: list[dict[str, Any]]) -> list[tuple[int, int, int]]:
    """Every member applied the same steps, once each, and holds the oracle's parameters
    for them; the steps' history."""
    history = results[0]["history"]
    for r in results[1:]:
        assert r["history"] == history, "members applied different steps"
    steps = [s for s, _, _ in history]
    assert steps == list(range(len(steps))), f"a step was applied twice or skipped: {steps}"
    want = oracle(history)
    for r in results:
        for got, expected in zip(r["params"], want):
            assert torch.allclose(got, expected, rtol=0, atol=1e-6), (
                f"rank {r['rank']}: max difference {(got - expected).abs().max():.3g}")
    return history
