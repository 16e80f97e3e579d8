"""DistributedSampler: torch's exact index sequence, padding, epochs and argument checks."""

from __future__ import annotations

import itertools

import pytest
import torch.utils.data.distributed as torch_dist_data

from tandem.errors import ArgumentError
from tandem.parallel.sampler import DistributedSampler
from tandem.testing import spawn


class Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


CASES = list(itertools.product([0, 1, 5, 10, 17, 64], [1, 2, 3, 4, 7], [True, False],
                               [True, False]))


@pytest.mark.parametrize("n,replicas,shuffle,drop_last", CASES)
def test_yields_the_same_indices_as_torch(n: int, replicas: int, shuffle: bool,
                                          drop_last: bool) -> None:
    data = Sized(n)
    for seed, epoch in [(0, 0), (0, 3), (1234, 1)]:
        for rank in range(replicas):
            ours = DistributedSampler(data, replicas, rank, shuffle, seed, drop_last)
            theirs = torch_dist_data.DistributedSampler(data, replicas, rank, shuffle, seed,
                                                        drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert len(ours) == len(theirs), (n, replicas, rank, seed, epoch)
            assert list(ours) == list(theirs), (n, replicas, rank, seed, epoch)


def test_padding_repeats_indices_so_every_rank_gets_the_same_count() -> None:
    shares = [list(DistributedSampler(Sized(5), 4, r, shuffle=False)) for r in range(4)]
    assert shares == [[0, 4], [1, 0], [2, 1], [3, 2]]


def test_drop_last_gives_disjoint_shares() -> None:
    shares = [set(DistributedSampler(Sized(10), 3, r, drop_last=True)) for r in range(3)]
    assert all(len(s) == 3 for s in shares)
    assert len(set.union(*shares)) == 9


def test_set_epoch_changes_the_permutation_and_is_reproducible() -> None:
    s = DistributedSampler(Sized(100), 2, 0, seed=7)
    first = list(s)
    s.set_epoch(1)
    second = list(s)
    s.set_epoch(0)
    assert first != second
    assert list(s) == first


@pytest.mark.parametrize("rank", [-1, 3, 10])
def test_rank_outside_range_is_an_argument_error(rank: int) -> None:
    with pytest.raises(ArgumentError, match=r"rank must be in \[0, 3\)"):
        DistributedSampler(Sized(10), num_replicas=3, rank=rank)


def test_seed_and_epoch_must_be_integers() -> None:
    import numpy as np

    s = DistributedSampler(Sized(10), num_replicas=2, rank=0, seed=np.int64(4))
    s.set_epoch(np.int32(2))
    assert (s.seed, s.epoch) == (4, 2) and len(list(s)) == 5
    with pytest.raises(ArgumentError, match="seed must be an int, got 'x'"):
        DistributedSampler(Sized(10), num_replicas=2, rank=0, seed="x")  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="epoch must be an int, got nan"):
        s.set_epoch(float("nan"))  # type: ignore[arg-type]


def test_non_positive_num_replicas_is_an_argument_error() -> None:
    with pytest.raises(ArgumentError, match="num_replicas"):
        DistributedSampler(Sized(10), num_replicas=0, rank=0)


def _shares_from_group(rank: int, world_size: int) -> tuple[int, int, list[int]]:
    s = DistributedSampler(Sized(11), seed=3)
    return s.rank, s.num_replicas, list(s)


@pytest.mark.procs
def test_defaults_come_from_the_default_group() -> None:
    results = spawn(2, _shares_from_group, timeout=60)
    for rank, (r, n, indices) in enumerate(results):
        assert (r, n) == (rank, 2)
        assert indices == list(torch_dist_data.DistributedSampler(Sized(11), 2, rank, seed=3))


@pytest.mark.parametrize("name", ["shuffle", "drop_last"])
def test_a_switch_that_is_not_a_bool_is_refused(name: str) -> None:
    # shuffle="no" shuffled and drop_last="no" dropped the tail, without a word
    with pytest.raises(ArgumentError, match=f"{name} must be True or False, got str 'no'"):
        DistributedSampler(Sized(5), num_replicas=2, rank=0, **{name: "no"})  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [{"num_replicas": True, "rank": 0},
                                    {"num_replicas": 2, "rank": False}])
def test_a_bool_is_not_taken_for_a_count_or_a_rank(kwargs: dict[str, bool]) -> None:
    with pytest.raises(ArgumentError, match="num_replicas must be a positive int|rank must be"):
        DistributedSampler(Sized(5), **kwargs)


@pytest.mark.parametrize("seed, epoch", [(1 << 64, 0), (-(1 << 63) - 1, 0), ((1 << 64) - 1, 1)])
def test_a_seed_plus_epoch_outside_a_generators_range_is_refused_before_iterating(
        seed: int, epoch: int) -> None:
    # it failed in the first __iter__ with "Overflow when unpacking long long"
    with pytest.raises(ArgumentError, match="outside the range a torch generator's seed"):
        DistributedSampler(Sized(5), num_replicas=2, rank=0, seed=seed).set_epoch(epoch)
    edge = DistributedSampler(Sized(5), num_replicas=1, rank=0, seed=(1 << 64) - 1)
    assert sorted(edge) == [0, 1, 2, 3, 4]


def test_a_dataset_without_a_length_is_refused_naming_it() -> None:
    with pytest.raises(ArgumentError, match="the dataset must have a length"):
        DistributedSampler(iter(range(5)), num_replicas=2, rank=0)  # type: ignore[arg-type]
