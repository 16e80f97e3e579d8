"""An argument only one rank checks (a root's list, a list passed where only the root takes
one) refused on that rank: its peers, already in the call, fail at once naming the problem,
not at their deadline.

torch with gloo raises on the rank at fault and leaves its peers waiting out the timeout.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest
import torch

import tandem
from tandem.errors import ArgumentError, CollectiveTimeoutError
from tandem.testing import run_threads

pytestmark = pytest.mark.timeout(120)

WS = 3
OP_TIMEOUT = 30.0  # a peer that waited this long failed by its deadline: the bug


def f(n: int = 2, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)


def lst(n: int = WS, size: int = 2) -> list[torch.Tensor]:
    return [f(size) for _ in range(n)]


# each case: (the rank at fault, the call given the group, text its error holds)
CASES: dict[str, tuple[int, Callable[[Any], Any], str]] = {
    "scatter, a wrong size in the source's list": (
        0, lambda g: tandem.scatter(f(), [f(), f(5), f()] if g.rank() == 0 else None, src=0,
                                    group=g), r"scatter_list[1] has 5 elements"),
    "scatter, no list on the source": (
        1, lambda g: tandem.scatter(f(), None if g.rank() == 1 else None, src=1, group=g),
        "source rank must pass scatter_list"),
    "scatter, a list on another rank": (
        2, lambda g: tandem.scatter(f(), lst() if g.rank() in (0, 2) else None, src=0, group=g),
        "scatter_list is used only on the source rank"),
    "gather, a list of the wrong length on the destination": (
        0, lambda g: tandem.gather(f(), lst(4) if g.rank() == 0 else None, dst=0, group=g),
        "gather_list has 4 tensors"),
    "gather, a list on another rank": (
        1, lambda g: tandem.gather(f(), lst() if g.rank() in (0, 1) else None, dst=0, group=g),
        "gather_list is used only on the destination rank"),
    "scatter_object_list, no inputs on the source": (
        0, lambda g: tandem.scatter_object_list([None], None, src=0, group=g),
        "must pass scatter_object_input_list"),
    "gather_object, no list on the destination": (
        2, lambda g: tandem.gather_object(g.rank(), None, dst=2, group=g),
        "must pass object_gather_list"),
    "gather_object, a list on another rank": (
        1, lambda g: tandem.gather_object(g.rank(), [None] * WS if g.rank() in (0, 1) else None,
                                          dst=0, group=g),
        "object_gather_list is used only on the destination rank"),
    "broadcast_object_list, a tuple on the source": (
        0, lambda g: tandem.broadcast_object_list(("a",) if g.rank() == 0 else [None], src=0,
                                                  group=g),
        "object_list must be a list, got tuple on rank 0"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_argument_of_one_rank_fails_its_peers_at_once_naming_it(case: str) -> None:
    culprit, call, text = CASES[case]

    def body(g: Any) -> tuple[str, str, float]:
        start = time.monotonic()
        try:
            call(g)
            # a peer that only sends (gather) may return first: its next call tells it
            tandem.barrier(group=g)
        except Exception as exc:  # noqa: BLE001 - compared below
            return type(exc).__name__, str(exc), time.monotonic() - start
        return "ok", "", time.monotonic() - start

    results = run_threads(WS, body, op_timeout=OP_TIMEOUT, timeout=100)
    kind, message, _ = results[culprit]
    assert kind == ArgumentError.__name__ and text in message, \
        f"rank {culprit} (at fault) raised {kind}: {message}"
    for rank, (kind, message, took) in enumerate(results):
        assert kind != CollectiveTimeoutError.__name__ and took < OP_TIMEOUT, \
            f"rank {rank} waited out its deadline ({took:.1f} s): {kind}: {message}"
        assert text in message and (rank == culprit or f"rank {culprit}" in message), \
            f"rank {rank} does not name rank {culprit}'s problem: {kind}: {message}"
