"""The cross-host benchmark's arithmetic: layouts and the bytes a host must move."""

from __future__ import annotations

import pytest

from tandem.bench._hosts import Layout, parse_layouts
from tandem.bench.collectives_hosts import link_bytes

MB = 1 << 20


def test_layouts_parse_as_hosts_x_ranks_and_place_ranks_host_by_host() -> None:
    assert parse_layouts("2x1, 2x2,4x1") == [Layout(2, 1), Layout(2, 2), Layout(4, 1)]
    assert Layout(2, 2).placement == [0, 0, 1, 1]
    assert Layout(3, 2).world_size == 6
    for bad in ("1x4", "2x0", "2by2", "", "x"):
        with pytest.raises(ValueError):
            parse_layouts(bad)


@pytest.mark.parametrize("op, layout, want", [
    ("all_reduce", Layout(2, 1), 1.0),       # half out, half back: 2 (H-1)/H
    ("all_reduce", Layout(4, 1), 1.5),
    ("all_reduce", Layout(2, 2), 1.0),       # ranks of a host reduce locally first
    ("reduce_scatter", Layout(4, 1), 0.75),
    ("all_gather", Layout(3, 1), 2.0),       # every other host's input comes in
    ("all_gather", Layout(2, 2), 2.0),       # ... all R of them
    ("broadcast", Layout(3, 1), 1.0),
])
def test_link_bytes_are_what_each_host_must_move(op: str, layout: Layout, want: float) -> None:
    assert link_bytes(op, 64 * MB, layout) == want * 64 * MB
