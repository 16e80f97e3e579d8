"""all_reduce of one tensor that fits one staging round (``shm._one_round``).

Sizes at and around the path's limit, each reduce op and a user-defined one, bit for
bit against the reduction computed locally in member order; consecutive calls use
both staging halves in turn while members drift apart, and calls through many rounds
come in between, so a call that read or overwrote the wrong half shows.
"""

from __future__ import annotations

from typing import Any

import pytest

from _shm_one_round_ranks import one_round_limits, strided_input
from tandem.testing import launch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(180)]


def _values(outcomes: Any) -> list[Any]:
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(f"--- rank {o.rank} ---\n{o.error}" for o in bad)
    return [o.value for o in outcomes]


@pytest.mark.parametrize("p", [2, 3])
def test_one_round_calls_match_the_member_order_reduction_around_the_limit(p: int) -> None:
    for rank, r in enumerate(_values(launch(p, one_round_limits, backend="shm", timeout=150))):
        assert not r["wrong"], f"rank {rank} of {p}: wrong results for {r['wrong']}"
        assert r["taken"] == r["expected"], (
            f"rank {rank} of {p}: the one-round path ran {r['taken']} times, "
            f"expected {r['expected']}")


@pytest.mark.parametrize("p", [2, 3])
def test_one_round_takes_a_strided_tensor_by_its_elements(p: int) -> None:
    for rank, r in enumerate(_values(launch(p, strided_input, backend="shm", timeout=150))):
        assert r["taken"] == 4, f"rank {rank} of {p}: the one-round path ran {r['taken']} times"
        assert all(r["right"].values()), f"rank {rank} of {p}: wrong results {r['right']}"
