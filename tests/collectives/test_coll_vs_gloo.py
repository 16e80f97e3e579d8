"""Every collective, p2p and object function agrees with torch.distributed on gloo.

Where gloo cannot answer (uneven all_to_all lists, a stacked all_gather_into_tensor
output) or answers wrongly (it corrupts non-contiguous outputs), the case names why
and the answer computed locally is the reference instead.

Each world size is one spawn: every rank joins both tandem (tcp) and gloo, runs each
case of ``_coll_ranks.CASES`` with both libraries on the same inputs, and returns the
results; each case is then its own test here. A case is written once against
``lib.dist`` (``tandem`` or ``torch.distributed``): porting really is one import.
"""

from __future__ import annotations

from typing import Any

import pytest

from tandem.testing import spawn

import _coll_ranks
from _coll_ranks import CASES, LOCAL_ANSWERS, encode

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"ws{ws}")
def both(request, tmp_path_factory) -> tuple[int, list[dict[str, dict[str, Any]]]]:
    world_size = request.param
    gloo_file = tmp_path_factory.mktemp("gloo") / "store"  # not created: gloo makes it
    results = spawn(world_size, _coll_ranks.tandem_and_gloo, (str(gloo_file),), timeout=100,
                    op_timeout=20)
    return world_size, results


def _describe(value: Any) -> str:
    if isinstance(value, tuple) and value and value[0] == "tensor":
        _, dtype, shape, values = value
        return f"{dtype}{list(shape)} {values}"
    if isinstance(value, tuple) and value and value[0] == "error":
        return f"raised {value[1]}"
    return repr(value)


@pytest.mark.parametrize("name", list(CASES))
def test_tandem_agrees_with_gloo(both, name: str) -> None:
    world_size, results = both
    for rank in range(world_size):
        got = results[rank][name]
        assert not (isinstance(got["tandem"], tuple) and got["tandem"][:1] == ("error",)), (
            f"rank {rank}: {name} with tandem {_describe(got['tandem'])}")
        if name in LOCAL_ANSWERS:
            why, answer = LOCAL_ANSWERS[name]
            reference, label = encode(answer(rank, world_size)), f"local ({why})"
        else:
            reference, label = got["gloo"], "gloo"
        assert got["tandem"] == reference, (
            f"rank {rank}: {name} differs:\n  tandem: {_describe(got['tandem'])}\n"
            f"  {label}: {_describe(reference)}")


def test_barrier_waits_for_the_last_rank_to_arrive(both) -> None:
    world_size, results = both
    for rank in range(world_size):
        assert results[rank]["barrier_waits_for_the_last_rank"]["tandem"] is True, (
            f"rank {rank} left tandem.barrier() before rank 0 entered it")
