"""``ElasticSampler``: each rank's share of every step's batch, whatever the membership.

A batch sampler for ``DataLoader(dataset, batch_sampler=...)``. The data is one
endless sequence: epoch ``e`` is a permutation of the dataset seeded by ``seed + e``
(or the dataset in order), and each step takes the next *global batch* from it, split
among the ranks in rank order. Where the sequence stands is part of the elastic
state: a commit records it, a rollback rewinds it, a joining worker receives it. How
the global batch follows the membership is the user's choice:

* ``mode="shrink"``: every rank keeps ``batch_size`` samples per step, so the global
  batch is ``batch_size x world size`` and shrinks while a rank is missing;
* ``mode="reshard"``: the global batch stays ``batch_size`` samples; each rank takes
  ``batch_size // world size`` of them (a remainder that does not divide is skipped).

Sizes are bounded by the machine: a shuffled dataset at most one sample per 64 bytes of
memory (its permutation's 8 bytes a sample in an eighth), ``batch_size`` at most one per
640 bytes.

The sampler counts steps with ``state.step``: the loop must add one to it per batch
taken (the batch of step ``s`` is fixed by ``s`` and the membership), so a loader that
prefetches never moves the recorded position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sized

import torch

from tandem._words import counted
from tandem.config import at_most, memory_limit, memory_text
from tandem.errors import ArgumentError

if TYPE_CHECKING:
    from tandem.elastic._state import ElasticState

__all__ = ["ElasticSampler"]

MODES = ("shrink", "reshard")


class ElasticSampler:
    """Batches of dataset indices for this rank; see the module docstring."""

    def __init__(self, data: Sized | int, state: ElasticState, batch_size: int, *,
                 mode: str = "shrink", shuffle: bool = True, seed: int = 0) -> None:
        size = data if isinstance(data, int) else len(data)
        if not isinstance(size, int) or size <= 0:
            raise ArgumentError(f"ElasticSampler: the dataset must hold at least one sample, "
                                f"got {size!r}")
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ArgumentError(f"ElasticSampler: batch_size must be a positive int, got "
                                f"{batch_size!r}")
        if mode not in MODES:
            raise ArgumentError(f"ElasticSampler: mode must be one of {MODES}, got {mode!r}")
        memory = memory_text()
        if shuffle:  # an epoch's permutation: 8 bytes a sample, within an eighth of memory
            at_most("ElasticSampler: dataset size", size, memory_limit() // 64,
                    f"samples: the shuffled order holds 8 bytes a sample, and may take an "
                    f"eighth of the {memory}", "give the dataset's true size, or "
                    "shuffle=False with the data shuffled once on disk")
        # a step's batch is a list of indices (about 40 bytes each), within a 16th of memory
        at_most("ElasticSampler: batch_size", batch_size, memory_limit() // 640,
                f"indices: about 40 bytes each in a list, within a 16th of the {memory}", "give the batch size in samples")
        if "step" not in state._values:
            raise ArgumentError("ElasticSampler counts steps with state.step: build the state "
                                "with a step value, e.g. ElasticState(model, opt, step=0)")
        self.size, self.batch_size, self.mode = size, batch_size, mode
        self.shuffle, self.seed = shuffle, seed
        self._state = state
        self._position = 0  # samples consumed before step ``_origin[0]``
        self._origin: tuple[int, int, int] | None = None  # (step, position, per step)
        self._epoch = -1
        self._order = torch.arange(0)
        state._add_sampler(self)

    # -- the position, as the elastic state keeps it ---------------------------------------
    def position_at(self, step: int) -> int:
        """Samples consumed before step ``step`` of the current iteration."""
        if self._origin is None:
            return self._position
        first, position, per_step = self._origin
        return position + (step - first) * per_step

    def _restore(self, position: int) -> None:
        self._position, self._origin = position, None

    def per_rank(self, world_size: int) -> int:
        if self.mode == "shrink":
            return self.batch_size
        per = self.batch_size // world_size
        if per == 0:
            raise ArgumentError(
                f"ElasticSampler(mode='reshard'): a global batch of {self.batch_size} cannot "
                f"be split among {counted(world_size, 'rank')}")
        return per

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        state = self._state
        rank, world = state.rank, state.world_size
        per = self.per_rank(world)
        step = state.step
        position = self.position_at(step)
        self._origin = (step, position, per * world)
        while True:
            start = position + rank * per
            yield [self._index(p) for p in range(start, start + per)]
            position += per * world

    def __len__(self) -> int:
        raise TypeError("an ElasticSampler is endless (it crosses epochs by itself); stop "
                        "the loop by the step count")

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, self.size)
        if not self.shuffle:
            return offset
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._order = torch.randperm(self.size, generator=gen)
            self._epoch = epoch
        return int(self._order[offset])

    def indices(self, step_position: int, rank: int, world_size: int) -> list[int]:
        """The indices rank ``rank`` of ``world_size`` takes for the step that starts at
        ``step_position`` (a reference run computes the same batches with it)."""
        per = self.per_rank(world_size)
        start = step_position + rank * per
        return [self._index(p) for p in range(start, start + per)]
