"""A list all-gather over tcp writes each rank's part straight into its output tensor.

``all_gather(tensor_list, tensor)`` on a group without shared memory and without a
hierarchical layout (one host, or one rank per host) runs the ring over the output
tensors themselves (``ring_gather_into``) when they are contiguous and disjoint,
instead of through a flat working buffer and two copies. Otherwise the flat path
stays. Either way every rank must end with every rank's input, bit for bit. Threads
over the loopback transport, whose ranks report the host names given to ``run_threads``.
"""

from __future__ import annotations

import pytest
import torch

import tandem
from tandem.collectives.algorithms.ring import separate
from tandem.collectives.group import ProcessGroup
from tandem.config import Settings
from tandem.testing import run_threads

from _coll_util import DTYPES, assert_equal, short

pytestmark = pytest.mark.timeout(60)

LINK = Settings(link_chunk_bytes=4096)
LAYOUTS = {"one host": lambda p: ["a"] * p, "host each": lambda p: list("abcde")[:p],
           "hosts unknown": lambda p: None}


def _part(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input: distinct per rank and element, exact in every dtype."""
    values = (torch.arange(numel) * 7 + rank * 3) % 100
    if dtype == torch.bool:
        return (values % 2 == 1)
    return values.to(dtype)


def _gather(world_size: int, numel: int, dtype: torch.dtype, hosts: list[str] | None,
            make_outs: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[torch.Tensor]], int]:
    """Every rank's gathered list, and how often a rank asked for working memory."""
    scratch = ProcessGroup.scratch
    asked = [0]

    def counted(self: ProcessGroup, n: int, dt: torch.dtype) -> torch.Tensor:
        asked[0] += 1
        return scratch(self, n, dt)

    monkeypatch.setattr(ProcessGroup, "scratch", counted)

    def body(group: ProcessGroup) -> list[torch.Tensor]:
        r = group.rank()
        if make_outs == "strided":  # every other element of a wider tensor
            outs = [torch.zeros(numel, 2, dtype=dtype)[:, 0] for _ in range(world_size)]
        elif make_outs == "views of one tensor":
            outs = list(torch.zeros(world_size * numel, dtype=dtype).split(numel))
        else:
            outs = [torch.zeros(numel, dtype=dtype) for _ in range(world_size)]
        tandem.all_gather(outs, _part(r, numel, dtype), group=group)
        return [t.clone() for t in outs]

    return run_threads(world_size, body, settings=LINK, hosts=hosts), asked[0]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
@pytest.mark.parametrize("numel", [0, 1, 1000, 5003])
def test_list_all_gather_lands_in_place_and_agrees(layout: str, world_size: int, numel: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for dtype in (torch.float32, torch.int64):
        results, asked = _gather(world_size, numel, dtype, LAYOUTS[layout](world_size),
                                 "separate", monkeypatch)
        for rank, outs in enumerate(results):
            for j, got in enumerate(outs):
                assert_equal(got, _part(j, numel, dtype),
                             f"rank {rank}: all_gather({short(dtype)}[{numel}]) part {j}")
        assert asked == 0, "the ring over the output tensors needs no working buffer"


@pytest.mark.parametrize("make_outs", ["strided", "views of one tensor"])
def test_other_output_lists_agree_too(make_outs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for dtype in DTYPES:
        results, asked = _gather(3, 3001, dtype, list("abc"), make_outs, monkeypatch)
        for rank, outs in enumerate(results):
            for j, got in enumerate(outs):
                assert_equal(got, _part(j, 3001, dtype),
                             f"rank {rank}: all_gather({short(dtype)}, {make_outs}) part {j}")
        # strided outputs go through the flat buffer; adjacent views need none
        assert (asked > 0) == (make_outs == "strided")


def test_separate_accepts_only_contiguous_disjoint_tensors() -> None:
    whole = torch.zeros(12)
    assert separate(list(whole.split(4)))
    assert separate([torch.zeros(3), torch.zeros(0), torch.zeros(5)])
    assert not separate([whole[:6], whole[4:10]])  # overlapping views
    assert not separate([whole, whole])  # one tensor twice
    assert not separate([torch.zeros(4, 2)[:, 0], torch.zeros(4)])  # strided
