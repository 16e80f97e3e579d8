"""Smoke test of ``python -m tandem.bench startup``'s pieces (benchmarks are not timed tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.bench.startup import format_table, measure


@pytest.mark.timeout(180)
@pytest.mark.procs
def test_one_tandem_launch_is_measured(tmp_path: Path) -> None:
    m = measure("tandem", 2, str(tmp_path))
    assert 0 < m["script"] <= m["init"] <= m["barrier"] <= m["exit"]


def test_table_has_a_ratio_per_world_size() -> None:
    row = {"world_size": 2, "tandem": {"script": 1.0, "import": 0.5, "init": 2.0, "exit": 3.0},
           "torch": {"script": 1.5, "import": 0.5, "init": 3.0, "exit": 4.0}}
    text = format_table([row])
    assert "tandemrun+tandem" in text and "torchrun+gloo" in text and "1.50" in text
    assert format_table([row], markdown=True).startswith("| ranks |")
