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
    assert 0 < m["init+barrier"] < m["exit"]


def _times(init: float, exit: float, barrier: float) -> dict[str, float]:
    return {"script": 1.0, "import": 0.5, "init": init, "exit": exit, "init+barrier": barrier}


def test_table_has_the_init_barrier_and_launch_ratios_per_world_size() -> None:
    row = {"world_size": 2, "tandem": _times(2.0, 3.0, 0.2), "torch": _times(3.0, 6.0, 0.1),
           "baseline": _times(2.5, 4.0, 0.4)}
    text = format_table([row], markdown=True)
    lines = [ln for ln in text.splitlines() if "tandemrun" in ln or "torchrun" in ln]
    assert [ln.split("|")[2].strip() for ln in lines] == [
        "tandemrun+tandem", "tandemrun+tandem (baseline)", "torchrun+gloo"]
    # init ratio 3.0/2.0, init+barrier 0.1/0.2, whole launch 3.0/6.0
    assert "| 1.50 | 0.20 | 0.50 | 0.50 |" in lines[0], lines[0]
    assert "| 1.20 | 0.40 | 0.25 | 0.67 |" in lines[1], lines[1]
    assert format_table([row]).startswith("ranks")
