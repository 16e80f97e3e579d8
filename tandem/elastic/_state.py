"""``ElasticState``: the training state an elastic job keeps, rolls back and hands on.

::

    state = ElasticState(model=ddp, optimizer=opt, step=0, history=[])
    state.step += 1              # the user's values are attributes
    state.commit()               # every N steps: a copy in memory, on every rank

A commit copies the model's parameters and buffers, the optimizer's state, the
user's values and the elastic samplers' positions into memory (no disk, no
communication) and keeps the last two commits: when a rank dies in the middle of a
step, the survivors may have passed one more commit than each other, never two, and
all roll back to the older one they share. Under :func:`~tandem.elastic.run_elastic`
a commit is also the step boundary where waiting joiners are let in.

The optimizer must hold its whole state on every rank (a plain ``torch.optim``
optimizer): ``ZeroRedundancyOptimizer`` and sharded gradients are refused, since a
dead rank would take its shard with it.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, TypeVar

import torch
from torch import nn

from tandem.collectives.world import get_rank, get_world_size
from tandem.config import MAX_WORLD_SIZE, at_most
from tandem.elastic._snapshot import Snapshot, capture, restore
from tandem.errors import ArgumentError
from tandem.parallel.ddp import DistributedDataParallel

__all__ = ["ElasticState"]


# what the state needs of a sampler and of run_elastic's session (both import this module)
class _Sampler(Protocol):
    def position_at(self, step: int) -> int: ...

    def _restore(self, position: int) -> None: ...


class _Session(Protocol):
    @property
    def number(self) -> int: ...

    def committed(self) -> None: ...


_S = TypeVar("_S", bound=_Session)

_OWN = frozenset({"model", "optimizer", "min_ranks", "_values", "_samplers", "_slots",
                  "_commits", "_session"})


class ElasticState:
    """See the module docstring. ``min_ranks``: the fewest ranks training may go on with."""

    def __init__(self, model: nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, *, min_ranks: int = 1,
                 **values: Any) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise ArgumentError(f"ElasticState: model must be an nn.Module (or a "
                                f"DistributedDataParallel), got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ArgumentError(f"ElasticState: optimizer must be a torch.optim.Optimizer, "
                                f"got {type(optimizer).__name__}")
        _refuse_sharded(model, optimizer)
        if not isinstance(min_ranks, int) or isinstance(min_ranks, bool) or min_ranks < 1:
            raise ArgumentError(f"ElasticState: min_ranks must be an int >= 1, got "
                                f"{min_ranks!r}")
        at_most("ElasticState: min_ranks", min_ranks, MAX_WORLD_SIZE,
                "MAX_WORLD_SIZE, the bound of a world size",
                "give the fewest ranks the job may train with")
        clash = sorted(set(values) & (_OWN | set(dir(type(self)))))
        if clash:
            raise ArgumentError(f"ElasticState: {clash} cannot be the names of values")
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "min_ranks", min_ranks)
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_samplers", [])
        object.__setattr__(self, "_slots", [])
        object.__setattr__(self, "_commits", 0)
        object.__setattr__(self, "_session", None)

    # -- the user's values as attributes ----------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"ElasticState has no value {name!r} (values: {sorted(values)})")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._values:
            self._values[name] = value
        elif name in ("model", "optimizer"):
            raise ArgumentError(f"ElasticState.{name} is fixed at construction")
        else:
            raise AttributeError(f"ElasticState has no value {name!r}; name every value when "
                                 f"constructing it: ElasticState(..., {name}=...)")

    # -- where training stands ------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank in the current membership."""
        return get_rank()

    @property
    def world_size(self) -> int:
        """Ranks in the current membership."""
        return get_world_size()

    @property
    def generation(self) -> int:
        """How many times the membership changed (0 before the first change)."""
        return -1 if self._session is None else self._session.number

    @property
    def module(self) -> nn.Module | None:
        """The model whose state is kept (the module inside a DDP)."""
        model = self.model
        return model.module if isinstance(model, DistributedDataParallel) else model

    def commit(self) -> None:
        """Keep the current state in memory; under ``run_elastic``, also let joiners in.

        Every rank must commit at the same steps. Letting joiners in interrupts the
        training function, which ``run_elastic`` calls again from this commit.
        """
        self._take(self._commits + 1)
        if self._session is not None:
            self._session.committed()

    # -- used by run_elastic, the session and the samplers (underscored: every other -----
    # -- attribute name belongs to the user's values) ------------------------------------
    def _open_session(self, make: Callable[[ElasticState], _S]) -> _S:
        """Run under a new session, ``make(self)``; one at a time."""
        if self._session is not None:
            raise ArgumentError("run_elastic: this ElasticState is already running")
        session = make(self)
        object.__setattr__(self, "_session", session)
        return session

    def _close_session(self) -> None:
        object.__setattr__(self, "_session", None)

    def _add_sampler(self, sampler: _Sampler) -> None:
        self._samplers.append(sampler)

    def _take(self, number: int) -> None:
        positions = [s.position_at(self.step if "step" in self._values else 0)
                     for s in self._samplers]
        snap = capture(number, self.module, self.optimizer, self._values, positions)
        object.__setattr__(self, "_commits", number)
        self._slots.append(snap)
        del self._slots[:-2]

    def _commits_held(self) -> list[int]:
        return [s.commit for s in self._slots]

    def _snapshot(self, number: int) -> Snapshot:
        for snap in self._slots:
            if snap.commit == number:
                return snap
        raise KeyError(number)

    def _roll_back(self, snap: Snapshot) -> None:
        """Make ``snap`` the live state and the only commit held."""
        if len(snap.positions) != len(self._samplers):
            raise ArgumentError(f"the live checkpoint holds {len(snap.positions)} sampler "
                                f"position(s), this worker has {len(self._samplers)} "
                                f"ElasticSampler(s): every worker must build the same ones")
        self._values.update(restore(snap, self.module, self.optimizer, self._values))
        for sampler, position in zip(self._samplers, snap.positions):
            sampler._restore(position)
        object.__setattr__(self, "_commits", snap.commit)
        self._slots[:] = [snap]


def _refuse_sharded(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> None:
    from tandem.optim import ZeroRedundancyOptimizer

    why = ("a lost rank would take its shard with it; in-place recovery needs every rank to "
           "hold the whole training state")
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise ArgumentError(f"ElasticState: ZeroRedundancyOptimizer shards the optimizer "
                            f"state: {why} (use the plain optimizer)")
    if isinstance(model, DistributedDataParallel) and model.reducer.shards is not None:
        raise ArgumentError(f"ElasticState: this DDP's gradients are sharded "
                            f"(shard_gradients): {why}")
