"""Smoke test of ``python -m tandem.bench torch-backend --quick``: it runs and prints a table.

Benchmarks are not timed tests: nothing here looks at the numbers beyond their being
positive. Run the benchmark itself with ``python -m tandem.bench torch-backend``.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tandem.bench import torch_backend as bench


def test_table_shows_speed_up_and_the_torch_layers_cost() -> None:
    rows = [{"part": "all_reduce", "what": "4 KB", "world": 2,
             "wall": {"tandem": 110e-6, "gloo": 440e-6, "tandem direct": 100e-6},
             "cpu": {"tandem": 84e-6, "gloo": 300e-6, "tandem direct": 80e-6}},
            {"part": "ddp", "what": "mlp", "world": 2, "wall": {"tandem": 0.05, "gloo": 0.1},
             "cpu": {"tandem": 0.04, "gloo": 0.09}}]
    lines = bench.format_table(rows).splitlines()
    assert lines[0].split()[:3] == ["ranks", "measure", "size"]
    assert "4.00" in lines[1] and "+10.0% (CPU +5.0%)" in lines[1], lines[1]
    assert "2.00" in lines[2] and lines[2].rstrip().endswith("-"), lines[2]
    assert bench.format_table(rows, markdown=True).startswith("| ranks | measure |")


def test_unknown_part_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--parts", "rpc"])
    assert exc.value.code == 2


@pytest.mark.timeout(300)
def test_quick_run_prints_every_part_against_gloo() -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem.bench", "torch-backend", "--quick"],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert any(ln.startswith("machine: ") for ln in lines), proc.stdout
    start = next(i for i, ln in enumerate(lines) if ln.startswith("ranks "))
    rows = [re.split(r"\s{2,}", ln.strip()) for ln in lines[start + 1:start + 5]]
    assert [r[1] for r in rows] == ["all_reduce", "coalesced", "ddp step", "fsdp step"], \
        proc.stdout
    for row in rows:
        speed_up = float(row[5])
        assert speed_up > 0, row
    assert lines[start + 5].startswith("torch layer per call"), proc.stdout
