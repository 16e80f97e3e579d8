"""Smoke test of ``python -m tandem.bench collectives --quick``: it runs and prints a table.

Run: ``python -m pytest tests/test_bench_smoke.py``. Benchmarks are not timed tests,
so nothing here looks at the numbers beyond their being positive.
"""

from __future__ import annotations

import re
import subprocess
import sys

ROW = re.compile(r"^\s*2\s+all_reduce\s+(4 KB|1 MB)\s+.*\s(\S+)$")


def test_quick_collectives_bench_prints_a_row_per_size_with_positive_ratios() -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem.bench", "collectives", "--quick"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert any(ln.startswith("machine: ") for ln in lines), proc.stdout
    assert any(re.match(r"^ranks\s+op\s+size\s+tandem lat\s+gloo lat", ln) for ln in lines), \
        proc.stdout
    rows = {m.group(1): m.group(2) for m in map(ROW.match, lines) if m}
    assert set(rows) == {"4 KB", "1 MB"}, proc.stdout
    for size, ratio in rows.items():
        assert float(ratio) > 0, f"{size}: ratio {ratio!r} is not a positive number"


def test_bench_without_a_command_exits_with_usage() -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem.bench"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "collectives" in proc.stderr
