"""``DistributedSampler``: each rank iterates over its own share of a dataset.

Same arguments, defaults and index sequence as
``torch.utils.data.distributed.DistributedSampler``, so a torch script keeps its
data order when it switches to tandem::

    sampler = tandem.parallel.DistributedSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)        # a new permutation each epoch, the same on all ranks
        for batch in loader: ...

Without ``drop_last`` the index list is padded by repeating it from its start
until it divides evenly, so every rank yields ``ceil(len / num_replicas)``
indices; with ``drop_last`` the tail is cut and every rank yields
``len // num_replicas``. Rank ``r`` takes every ``num_replicas``-th index
starting at ``r``. Only this rank's share is ever built (the padded list is
not), and ``num_replicas`` is at most ``MAX_WORLD_SIZE``, the bound of a world size.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Iterator, Sized

import torch
from torch.utils.data import Sampler

from tandem.collectives.checks import bool_arg
from tandem.collectives.world import get_rank, get_world_size
from tandem.config import MAX_WORLD_SIZE, at_most
from tandem.errors import ArgumentError

__all__ = ["DistributedSampler"]


def _whole(what: str, value: Any) -> int:
    # seed + epoch seed the permutation: anything but an integer failed later, in __iter__
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)  # numpy's integers too
    except TypeError:
        raise ArgumentError(f"DistributedSampler: {what} must be an int, got {value!r}") from None


class DistributedSampler(Sampler[int]):
    """Restrict data loading to one rank's share of ``dataset``.

    ``num_replicas`` and ``rank`` default to the default group's size and this
    process's rank (tandem must then be initialised). ``seed`` must be the same on
    every rank, or the shares overlap.
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        bool_arg(shuffle, "DistributedSampler", "shuffle")
        bool_arg(drop_last, "DistributedSampler", "drop_last")
        if num_replicas is None:
            num_replicas = get_world_size()
        if rank is None:
            rank = get_rank()
        if not isinstance(num_replicas, int) or num_replicas <= 0:
            raise ArgumentError(
                f"DistributedSampler: num_replicas must be a positive int, got {num_replicas!r}")
        at_most("DistributedSampler: num_replicas", num_replicas, MAX_WORLD_SIZE,
                "MAX_WORLD_SIZE, the bound of a world size",
                "give the number of ranks that share the dataset (default: the world size)")
        if not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ArgumentError(f"DistributedSampler: rank must be in [0, {num_replicas}) "
                                f"for num_replicas={num_replicas}, got {rank!r}")
        self.dataset = dataset
        self.seed = _whole("seed", seed)
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        n = len(dataset)
        self.num_samples = n // num_replicas if drop_last else math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def _order(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        # torch seeds a fresh CPU generator with seed + epoch and draws one randperm
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        n = len(order)
        # position i of the list padded by cycling from its start (torch's padding) holds
        # order[i % n]: this rank's share is read from there, without the padded list
        return iter([order[i % n]
                     for i in range(self.rank, self.total_size, self.num_replicas)])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use a different permutation for ``epoch``; call it on every rank before iterating."""
        self.epoch = _whole("set_epoch: epoch", epoch)
