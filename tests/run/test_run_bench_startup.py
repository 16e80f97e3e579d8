"""Smoke test of ``python -m tandem.bench startup``'s pieces (benchmarks are not timed tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.bench._hosts import Layout, simulated_hosts
from tandem.bench.startup import format_table, measure, measure_hosts
from tandem.testing.links import LinkShape
from tandem.testing.netns import unavailable_reason


@pytest.mark.timeout(180)
@pytest.mark.procs
def test_one_tandem_launch_is_measured(tmp_path: Path) -> None:
    m = measure("tandem", 2, str(tmp_path))
    assert 0 < m["script"] <= m["init"] <= m["barrier"] <= m["exit"]
    assert 0 < m["init+barrier"] < m["exit"]
    assert 50 < m["pss"] < 2000, "the ranks' memory, in MB"
    assert m["import"] < 0.5, "the workers were forked from the zygote: torch was imported"


@pytest.mark.timeout(300)
@pytest.mark.procs
@pytest.mark.skipif(bool(unavailable_reason()), reason=unavailable_reason() or "-")
@pytest.mark.parametrize("lib", ["tandem", "torch"])
def test_a_launch_across_simulated_hosts_is_measured(lib: str) -> None:
    with simulated_hosts(Layout(2, 2), LinkShape()) as hosts:
        m = measure_hosts(lib, hosts, str(hosts.workdir), 29411)
    assert 0 < m["script"] <= m["init"] <= m["barrier"] <= m["exit"]


def _times(init: float, exit: float, init_barrier: float, barrier: float,
           pss: float = 0.0) -> dict[str, float]:
    return {"script": 1.0, "import": 0.5, "init": init, "barrier": barrier, "exit": exit,
            "init+barrier": init_barrier, "pss": pss}


def test_table_has_the_init_barrier_and_launch_ratios_per_world_size() -> None:
    row = {"world_size": 2, "tandem": _times(2.0, 3.0, 0.2, 2.5, 700.0),
           "torch": _times(3.0, 6.0, 0.1, 5.0, 1400.0),
           "baseline": _times(2.5, 4.0, 0.4, 4.0)}
    text = format_table([row], markdown=True)
    lines = [ln for ln in text.splitlines() if "tandemrun" in ln or "torchrun" in ln]
    assert [ln.split("|")[2].strip() for ln in lines] == [
        "tandemrun+tandem", "tandemrun+tandem (baseline)", "torchrun+gloo"]
    # init ratio 3.0/2.0, init+barrier 0.1/0.2, to the first barrier 2.5/5.0, exit 3.0/6.0
    assert "| 1.50 | 0.20 | 0.50 | 0.50 | 0.50 | 700 |" in lines[0], lines[0]
    assert "| 1.20 | 0.40 | 0.25 | 0.80 | 0.67 | 0 |" in lines[1], lines[1]
    assert lines[2].endswith("| 1400 |"), lines[2]
    assert format_table([row]).startswith("ranks")
