"""The pieces of DDP that need no second process: bucketing, graph walks, statistics.

Run: ``python -m pytest tests/parallel/test_ddp_units.py -q``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tandem.parallel._buckets import assign_buckets
from tandem.parallel._ddp_stats import DDPStats, StepTimes, interval_overlap, interval_union
from tandem.parallel._graph import find_tensors, reachable_parameters

KB = 1024


def _floats(*kbytes: float, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(int(k * KB) // torch.finfo(dtype).bits * 8, dtype=dtype)
            for k in kbytes]


def test_buckets_start_from_the_last_parameter_and_the_first_one_is_small() -> None:
    params = _floats(4, 4, 4, 4, 4, 4)
    # first bucket closes at >= 6 KB, the others at >= 10 KB
    assert assign_buckets(params, 10 * KB, 6 * KB) == [[5, 4], [3, 2, 1], [0]]


def test_a_parameter_larger_than_the_cap_gets_a_bucket_of_its_own() -> None:
    params = _floats(1, 50, 1)
    assert assign_buckets(params, 10 * KB, 2 * KB) == [[2, 1], [0]]
    assert assign_buckets(params, 10 * KB, 1 * KB) == [[2], [1], [0]]


def test_buckets_never_mix_dtypes() -> None:
    params = [*_floats(1, 1), *_floats(1, 1, dtype=torch.float64)]
    layout = assign_buckets(params, 100 * KB, 100 * KB)
    assert sorted(map(sorted, layout)) == [[0, 1], [2, 3]]
    assert layout[0] == [3, 2], "the bucket holding the last parameter goes first"


def test_every_parameter_is_in_exactly_one_bucket() -> None:
    params = _floats(*([0.3] * 17 + [3] * 5))
    layout = assign_buckets(params, 2 * KB, 1 * KB)
    assert sorted(i for b in layout for i in b) == list(range(len(params)))


def test_graph_walk_finds_the_parameters_that_get_no_gradient() -> None:
    a, b, unused = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)
    out = {"y": [b(torch.relu(a(torch.randn(2, 3))))], "n": 3}
    reach = reachable_parameters(find_tensors(out))
    assert all(id(p) in reach for p in [*a.parameters(), *b.parameters()])
    assert not any(id(p) in reach for p in unused.parameters())


def test_find_tensors_looks_inside_containers_and_dataclasses() -> None:
    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        extra: dict

    t1, t2, t3 = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    found = find_tensors((Out(t1, {"k": [t2]}), "text", {t3}))
    assert {id(t) for t in found} == {id(t1), id(t2), id(t3)}


def test_interval_helpers_merge_and_clip() -> None:
    merged = interval_union([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)])
    assert merged == [(0.0, 2.0), (3.0, 4.0)]
    assert interval_overlap(merged, 1.0, 3.5) == 1.5


def test_stats_keep_the_last_step_and_the_running_mean() -> None:
    stats = DDPStats()
    stats.record(StepTimes(forward_s=1.0, comm_s=2.0, buckets=2))
    stats.record(StepTimes(forward_s=3.0, comm_s=4.0, buckets=2))
    assert stats.steps == 2 and stats.last.forward_s == 3.0
    assert stats.mean.forward_s == 2.0 and stats.mean.comm_s == 3.0
    assert "2 steps" in repr(stats)
    stats.reset()
    assert stats.steps == 0 and stats.mean.forward_s == 0.0
