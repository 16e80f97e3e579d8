"""DiLoCo under in-place recovery: a rank killed mid-run does not stop the others, and a
joiner receives the outer state (outer parameters, outer optimizer, exchanges in flight)
through the live checkpoint, as a value of the ``ElasticState``.

The job is tests/elastic's (same data, sampler, kill and join signals) with DiLoCo in
place of DDP: streaming, two fragments, each exchange finished one step after it started,
so every commit holds an exchange in flight.

Run: ``python -m pytest tests/algorithms/test_diloco_elastic.py -q``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import tandem
from tandem.algorithms.diloco import DiLoCo
from tandem.elastic import ElasticSampler, ElasticState, run_elastic
from tandem.testing import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "elastic"))
import _elastic_job as ej  # noqa: E402
from test_elastic_recovery import store_port  # noqa: E402,F401 - the test's TCPStore

pytestmark = pytest.mark.procs

def _outer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def diloco_job(rank: int, world_size: int, spec: ej.Spec) -> dict[str, Any]:
    joiner = rank >= spec.members
    os.environ["TANDEM_ELASTIC_STORE"] = f"tcp://127.0.0.1:{spec.store_port}?prefix={ej.PREFIX}"
    os.environ["TANDEM_ELASTIC_ID"] = f"w{rank}"
    os.environ["TANDEM_ELASTIC_MAX_RANKS"] = str(spec.max_ranks)
    signals = ej._store(spec)
    if joiner:
        os.environ["TANDEM_ELASTIC_JOIN"] = "1"
        tandem.init_process_group(spec.backend, store=tandem.HashStore(), rank=0, world_size=1,
                                  timeout=30)
        signals.wait(["test/join-now"], 60)
    else:
        tandem.init_process_group(spec.backend, init_method=spec.pg_url, rank=rank,
                                  world_size=spec.members, timeout=spec.op_timeout)
    x, y = ej.data()
    net = ej.model()
    opt = ej.optimizer(net)
    diloco = DiLoCo(net, opt, outer_optimizer=_outer, sync_every=2, fragments=2, delay=1)
    state = ElasticState(model=net, optimizer=opt, step=0, history=[], diloco=diloco)
    sampler = ElasticSampler(ej.N, state, ej.BATCH, seed=ej.SEED)
    if rank == spec.victim and not joiner:
        ej.arm_kill(spec.kill_step, spec.where, net, opt, state)

    @run_elastic(state)
    def train(state: ElasticState) -> None:
        for idx in sampler:
            if state.step >= spec.steps:
                return
            F.mse_loss(net(x[idx]), y[idx]).backward()
            opt.step()
            opt.zero_grad()
            diloco.step()
            state.history.append((state.step, state.world_size))
            state.step += 1
            if state.step == spec.rejoin_step and state.world_size < spec.members:
                ej._await_joiner(signals)  # so that this commit lets it in
            state.commit()

    train()
    diloco.sync()  # the exchange in flight at the end, on every rank at once
    loss = F.mse_loss(torch.func.functional_call(net, dict(zip(
        [n for n, _ in net.named_parameters()], diloco.outer_params)), (x,)), y).item()
    signals.close()
    return {"outer": [p.clone() for p in diloco.outer_params],
            "history": list(state.history), "rank": tandem.get_rank(), "joiner": joiner,
            "counters": (diloco.inner_steps, diloco.outer_steps), "loss": loss,
            "start_loss": F.mse_loss(ej.model()(x), y).item()}


@pytest.mark.timeout(180)
def test_a_killed_rank_does_not_stop_the_others_and_a_joiner_gets_the_outer_state(
        tmp_path: Path, store_port: int) -> None:  # noqa: F811
    spec = ej.Spec(steps=16, members=3, pg_url=f"file://{tmp_path}/pg", store_port=store_port,
                   backend="tcp", victim=1, kill_step=7, rejoin_step=12)
    outcomes = launch(4, diloco_job, (spec,), init=False, timeout=150)
    assert not outcomes[1].ok and outcomes[1].exitcode == -9, f"not killed: {outcomes[1]}"
    failed = [o for o in outcomes if not o.ok and o.rank != 1]
    assert not failed, "\n".join(f"rank {o.rank}: {o.error}" for o in failed)
    results = [o.value for o in outcomes if o.ok]
    assert len(results) == 3 and results[-1]["joiner"], "the joiner did not join"
    history = results[0]["history"]
    assert all(r["history"] == history for r in results), "members applied different steps"
    assert [s for s, _ in history] == list(range(16)), "a step was applied twice or skipped"
    sizes = [w for _, w in history]
    # killed in step 7's backward, before its exchange of step 7 started; the survivors
    # notice when an exchange with it fails: finishing step 7's (at step 8) at the latest
    first_small = sizes.index(2)
    assert first_small in (7, 8), sizes
    assert sizes == [3] * first_small + [2] * (12 - first_small) + [3] * 4, sizes
    # the joiner got the outer state: its outer parameters and counters are the others'
    for r in results:
        assert r["counters"] == results[0]["counters"] == (16, 16), r["counters"]
        for a, b in zip(r["outer"], results[0]["outer"]):
            assert torch.equal(a, b), f"rank {r['rank']}: outer parameters differ"
    # training went on: the outer model fits better than at the start (0.78 -> about 0.5)
    assert results[0]["loss"] < 0.8 * results[0]["start_loss"], (results[0]["loss"],
                                                                 results[0]["start_loss"])
