"""Drivers for the Ray tests, run on the cluster's head node: ``_ray_driver.py MODE [ARGS]``.

Each prints one JSON line ``RESULT {...}`` with what the test checks:

* ``kill``: rank 1's actor SIGKILLs itself after one all-reduce; the driver's error.
* ``elastic``: the elastic oracle job (``tests/elastic/_elastic_job.py``) on 2 ranks;
  rank 1's first actor is killed at step 3 and replaced in place.
* ``refuse``: more STRICT_SPREAD workers than nodes; the driver's error.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from tandem.errors import TandemError
from tandem.ray import ScalingConfig, Trainer

# the functions below travel to the actors by value (this is __main__); what they import
# from the repository's tests/ they find through these paths (the
# simulated nodes share this file system)
PATHS = [str(Path(__file__).resolve().parents[2] / "tests" / "elastic")]


def _paths() -> None:
    for p in PATHS:
        if p not in sys.path:
            sys.path.insert(0, p)


def killed() -> int:
    import torch

    import tandem

    torch.set_num_threads(1)
    tandem.init_process_group()
    tandem.all_reduce(torch.ones(1))
    if tandem.get_rank() == 1:
        print("rank 1 kills its own actor", flush=True)
        time.sleep(0.5)  # its line reaches the driver first
        os.kill(os.getpid(), signal.SIGKILL)
    tandem.all_reduce(torch.ones(1))  # the survivor loses its peer here
    return 0


def elastic(config: dict[str, Any]) -> dict[str, Any]:
    """``_elastic_job.job`` under tandem.ray: membership and rendezvous from the actor's
    environment; the first actor of slot 1 dies at step ``kill_step``."""
    _paths()
    import _elastic_job
    import torch
    import torch.nn.functional as F

    import tandem
    from tandem.elastic import ElasticSampler, ElasticState, run_elastic
    from tandem.elastic.roster import Roster
    from tandem.parallel import DistributedDataParallel
    from tandem.store.tcp import TCPStore

    torch.set_num_threads(1)
    tandem.init_process_group()  # a joiner: a world of its own until it is let in
    steps, kill_step, rejoin_step = config["steps"], config["kill_step"], config["rejoin_step"]
    victim = os.environ["TANDEM_ELASTIC_ID"] == "w1.0"
    x, y = _elastic_job.data()
    net = _elastic_job.model()
    ddp = DistributedDataParallel(net)
    opt = _elastic_job.optimizer(net)
    state = ElasticState(model=ddp, optimizer=opt, step=0, history=[])
    sampler = ElasticSampler(_elastic_job.N, state, _elastic_job.BATCH, seed=_elastic_job.SEED)
    url = os.environ["TANDEM_ELASTIC_STORE"].removeprefix("tcp://").partition("?")[0]
    host, _, port = url.rpartition(":")
    signals = TCPStore(host, int(port), wait_for_workers=False, timeout=120)
    roster = Roster(signals, "tandem/ray/elastic")

    @run_elastic(state)
    def train(state: ElasticState) -> None:
        for idx in sampler:
            if state.step >= steps:
                return
            if victim and state.step == kill_step:
                print("victim: SIGKILL", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            loss = F.mse_loss(ddp(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.history.append((state.step, state.world_size,
                                  sampler.position_at(state.step)))
            state.step += 1
            if state.step == rejoin_step and state.world_size < 2:
                deadline = time.monotonic() + 150  # the replacement imports torch: slow
                while not roster.joiners() and time.monotonic() < deadline:
                    time.sleep(0.05)
            state.commit()

    train()
    signals.close()
    return {"params": [p.detach().clone() for p in net.parameters()],
            "history": list(state.history), "rank": tandem.get_rank(),
            "world_size": tandem.get_world_size(),
            "name": os.environ["TANDEM_ELASTIC_ID"], "secret": os.environ["TANDEM_SECRET"]}


def main() -> None:
    mode = sys.argv[1]
    result: dict[str, Any] = {}
    t0 = time.monotonic()
    if mode == "kill":
        try:
            Trainer(killed, scaling_config=ScalingConfig(
                num_workers=2, cpus_per_worker=0.5, placement_strategy="STRICT_SPREAD")).fit()
        except TandemError as exc:
            result.update(error=type(exc).__name__, message=str(exc),
                          rank=getattr(exc, "rank", None), node=getattr(exc, "node", None))
    elif mode == "elastic":
        trainer = Trainer(elastic, train_loop_config={"steps": 8, "kill_step": 3,
                                                      "rejoin_step": 5},
                          scaling_config=ScalingConfig(num_workers=2, cpus_per_worker=0.5,
                                                       placement_strategy="STRICT_SPREAD"),
                          max_restarts=1)
        ranks = trainer.fit()
        _paths()
        import _elastic_job

        _elastic_job.check_against_oracle(ranks)  # raises if a rank differs from it
        result.update(replaced=trainer.replaced, failures=trainer.failures,
                      history=ranks[0]["history"], names=[r["name"] for r in ranks],
                      worlds=[r["world_size"] for r in ranks],
                      secrets=[r["secret"] for r in ranks])
    elif mode == "refuse":
        try:
            Trainer(killed, scaling_config=ScalingConfig(
                num_workers=3, cpus_per_worker=0.5, placement_strategy="STRICT_SPREAD")).fit()
        except TandemError as exc:
            result.update(error=type(exc).__name__, message=str(exc))
    result["seconds"] = round(time.monotonic() - t0, 1)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
