"""``python -m tandem.bench slow-links``: its smoke mode runs on simulated hosts, and its
verdicts on the issue's targets follow from the measured figures.

Run: ``python -m pytest tests/test_bench_slow_links.py``. The smoke run needs root and
iproute2 (network namespaces) and skips, saying why, elsewhere; about 60 s on 2 cores.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.bench.slow_links import Result, format_table, methods_for, targets
from tandem.testing.netns import unavailable_reason


def _result(method: str, seconds: float, link_bytes: int, loss: float) -> Result:
    return Result(method, seconds, tokens=100_000, link_bytes=link_bytes, steps=100,
                  val_loss=loss, val_curve=[(0, 0.0, 4.5), (100, seconds, loss)],
                  sync_bytes=None)


def test_targets_say_which_hold_from_the_figures() -> None:
    results = [_result("ddp", 100.0, 100_000_000, 2.00),
               _result("diloco", 16.0, 4_000_000, 2.05),  # 6.25x, +2.5%, 1/25 of the bytes
               _result("streaming-diloco", 11.0, 4_000_000, 2.06),
               _result("compute-only", 10.0, 200_000, 2.10)]
    lines = targets(results, inner=20)
    assert "6.25x DDP's" in lines[0] and ">= 5x" in lines[0] and "not slower" in lines[0]
    assert "+2.5% (target within 3%): holds" in lines[1], lines[1]
    assert "0.0400 of DDP's (target <= 1/H = 0.0500): holds" in lines[2], lines[2]
    # plain DiLoCo adds 6 s to compute; streaming shows 1 of them: 83% hidden
    assert "hides 83% of the 6.0 s" in lines[3] and lines[3].endswith("holds"), lines[3]
    worse = targets([_result("ddp", 100.0, 100_000_000, 2.00),
                     _result("diloco", 120.0, 10_000_000, 2.10)], inner=20)
    assert "SLOWER" in worse[0] and "< 5x" in worse[0]
    assert worse[1].endswith("MISSED") and worse[2].endswith("MISSED")


def test_table_compares_each_method_with_ddp() -> None:
    table = format_table([_result("ddp", 100.0, 100_000_000, 2.0),
                          _result("diloco", 20.0, 5_000_000, 2.02)], markdown=True)
    rows = [ln for ln in table.splitlines() if ln.startswith("| diloco")]
    assert rows and "| 5.00x |" in rows[0] and "| 0.050 MB |" in rows[0] and "+1.0%" in rows[0]
    repeated = _result("ddp", 100.0, 100_000_000, 2.0)
    repeated.all_seconds = [131.0, 100.0]  # the fastest is kept, the range shown
    assert "| 100.0 s (100-131) |" in format_table([repeated], markdown=True)


@pytest.mark.procs
def test_unknown_methods_and_impossible_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown fedavg"):
        methods_for(["ddp", "fedavg"], 10, 2, 1)
    bad = subprocess.run([sys.executable, "-m", "tandem.bench", "slow-links", "--steps", "10",
                          "--inner-steps", "20"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--inner-steps (20) <= --steps (10)" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "tandem.bench", "slow-links", "--batch-size",
                          "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--batch-size 0: must be at least 1" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "tandem.bench", "slow-links", "--outer-momentum",
                          "1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "0 <= momentum < 1" in bad.stderr, bad.stderr


def test_outer_optimizer_flags_go_to_the_diloco_methods_only() -> None:
    outer = ["--outer-lr", "1.0", "--outer-momentum", "0.5"]
    by = {m.name: m.flags for m in methods_for(
        ["ddp", "local-sgd", "diloco", "streaming-diloco", "compute-only"], 40, 20, 4, outer)}
    for name in ("diloco", "streaming-diloco"):
        assert by[name][-4:] == outer, by[name]
    for name in ("ddp", "local-sgd", "compute-only"):
        assert "--outer-lr" not in by[name], by[name]


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_smoke_mode_trains_every_method_and_writes_table_and_plot(tmp_path: Path) -> None:
    why = unavailable_reason()
    if why:
        pytest.skip(f"network namespaces are unavailable: {why}")
    done = subprocess.run([sys.executable, "-m", "tandem.bench", "slow-links", "--smoke",
                           "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-4000:]}"
    table = (tmp_path / "slow_links.md").read_text()
    ran = json.loads((tmp_path / "slow_links.json").read_text())
    methods = [r["method"] for r in ran]
    skipped = re.search(r"^skipped (.*):", done.stdout, re.M)
    expected = ["ddp", "local-sgd", "diloco", "streaming-diloco", "compute-only"]
    if skipped:  # only the DiLoCo methods, and only when this tandem has no DiLoCo
        assert skipped.group(1) == "diloco, streaming-diloco", done.stdout
        expected = ["ddp", "local-sgd", "compute-only"]
    assert methods == expected, done.stdout
    for r in ran:
        assert r["seconds"] > 0 and r["link_bytes"] > 0 and r["steps"] == 4, r
        assert [p[0] for p in r["val_curve"]] == [0, 2, 4], r  # the plot's points
        assert f"| {r['method']} |" in table
    assert (tmp_path / "slow_links.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
