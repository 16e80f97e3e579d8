"""PowerSGDState's arguments: each one torch takes is checked at construction (a wrong
type or value fails there, naming it, not in the middle of a backward) or honoured."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tandem.errors import ArgumentError
from tandem.parallel.comm_hooks import PowerSGDState

BAD = [
    ("matrix_approximation_rank", 0), ("matrix_approximation_rank", 1.5),
    ("matrix_approximation_rank", "2"), ("start_powerSGD_iter", -1),
    ("start_powerSGD_iter", float("nan")), ("min_compression_rate", float("nan")),
    ("min_compression_rate", -1), ("min_compression_rate", "2"),
    ("orthogonalization_epsilon", -1e-8), ("orthogonalization_epsilon", float("inf")),
    ("use_error_feedback", "no"), ("warm_start", "no"), ("batch_tensors_with_same_shape", "no"),
    ("random_seed", 0.5), ("compression_stats_logging_frequency", 0),
    ("process_group", "gloo"),
]


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_a_bad_argument_is_refused_at_construction_naming_it(name: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"process_group": None, name: value}
    with pytest.raises(ArgumentError, match=f"PowerSGDState: {name}|group must be"):
        PowerSGDState(**kwargs)


class _Last:
    """The one bucket of a model: the end of every iteration."""

    def is_last(self) -> bool:
        return True


def test_compression_stats_are_logged_every_logging_frequency_iterations(
        caplog: pytest.LogCaptureFixture) -> None:
    # the argument was stored and never read
    state = PowerSGDState(None, start_powerSGD_iter=2, compression_stats_logging_frequency=3)
    bucket: Any = _Last()
    with caplog.at_level(logging.INFO, logger="tandem.parallel._powersgd"):
        for _ in range(9):
            state.maybe_increase_iter(bucket)
    logged = [r.getMessage() for r in caplog.records if "compression stats" in r.getMessage()]
    assert [m.split(",")[0] for m in logged] == [
        "PowerSGD compression stats: iter 2", "PowerSGD compression stats: iter 5",
        "PowerSGD compression stats: iter 8"], logged
