"""Flags of the training API must be True or False: "no" is true to Python and would be
taken silently (the collectives' own flags: tests/collectives/test_coll_api_arguments.py)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from tandem.algorithms.join import Join
from tandem.errors import ArgumentError
from tandem.optim import ZeroRedundancyOptimizer
from tandem.parallel.sampler import DistributedSampler

CALLS: dict[str, Callable[[Any], Any]] = {
    "DistributedSampler: shuffle": lambda v: DistributedSampler(range(4), 2, 0, shuffle=v),
    "DistributedSampler: drop_last": lambda v: DistributedSampler(range(4), 2, 0, drop_last=v),
    "ZeroRedundancyOptimizer: parameters_as_bucket_view": lambda v: ZeroRedundancyOptimizer(
        [torch.zeros(2, requires_grad=True)], torch.optim.SGD, lr=0.1,
        parameters_as_bucket_view=v),
    "ZeroRedundancyOptimizer: overlap_with_ddp": lambda v: ZeroRedundancyOptimizer(
        [torch.zeros(2, requires_grad=True)], torch.optim.SGD, lr=0.1, overlap_with_ddp=v),
    "Join: enable": lambda v: Join([], enable=v),
    "Join: throw_on_early_termination": lambda v: Join([], throw_on_early_termination=v),
}


@pytest.mark.parametrize("value", ["no", 1, None], ids=repr)
@pytest.mark.parametrize("flag", list(CALLS))
def test_a_flag_that_is_not_a_bool_is_refused_naming_it(flag: str, value: object) -> None:
    with pytest.raises(ArgumentError, match=f"{flag} must be True or False, got "
                                            f"{type(value).__name__}"):
        CALLS[flag](value)
