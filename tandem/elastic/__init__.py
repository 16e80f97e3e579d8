"""In-place recovery for data-parallel training: survive a lost rank without a restart.

::

    import tandem as dist
    from tandem.elastic import ElasticSampler, ElasticState, run_elastic

    dist.init_process_group()
    model = DistributedDataParallel(Net())
    opt = torch.optim.AdamW(model.parameters())
    state = ElasticState(model=model, optimizer=opt, step=0)
    loader = DataLoader(data, batch_sampler=ElasticSampler(data, state, batch_size=16))

    @run_elastic(state)
    def train(state):
        for x, y in loader:
            if state.step == steps:
                break
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            state.step += 1
            if state.step % 10 == 0:
                state.commit()          # in memory; also where joiners are let in

    train()

Launched with ``tandemrun`` the survivors keep running when a worker dies: they roll
back to the last commit, form a new group without it, and go on; the launcher starts
a replacement (``--max-restarts``) that joins at a commit and receives the state from
a live worker. Pieces: :mod:`~tandem.elastic._state` (what is kept),
:mod:`~tandem.elastic._run` (the decorator), :mod:`~tandem.elastic._session` (one
worker's membership), :mod:`~tandem.elastic.roster` (membership in the store, shared
with the launcher), :mod:`~tandem.elastic._live` (the checked live checkpoint),
:mod:`~tandem.elastic._sampler` (the data each rank takes).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["ElasticState", "ElasticSampler", "run_elastic"]

# resolved on first use: the launcher imports tandem.elastic.roster without torch
_EXPORTS = {"ElasticState": "tandem.elastic._state", "ElasticSampler": "tandem.elastic._sampler",
            "run_elastic": "tandem.elastic._run"}

if TYPE_CHECKING:
    from tandem.elastic._run import run_elastic
    from tandem.elastic._sampler import ElasticSampler
    from tandem.elastic._state import ElasticState


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tandem.elastic' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
