"""Smoke test of ``python -m tandem.bench rpc --quick``: it runs both libraries and prints
a row per transport and case. Benchmarks are not timed tests: nothing here looks at the
numbers beyond their being positive."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tandem.bench import rpc as bench

pytestmark = pytest.mark.timeout(300)


def test_quick_bench_prints_every_case_against_torch() -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem.bench", "rpc", "--quick",
                           "--transports", "auto,tcp"], capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("machine: "), proc.stdout
    rows = [re.split(r"\s{2,}", ln.strip()) for ln in lines if ln.startswith(("auto", "tcp"))]
    assert [(r[0], r[1]) for r in rows] == [(t, c) for t in ("auto", "tcp")
                                            for c in bench.CASES], proc.stdout
    for row in rows:
        assert float(row[4]) > 0, row


def test_markdown_table_keeps_the_columns() -> None:
    row = {"transport": "auto", "case": "echo", "tandem": 1e-4, "torch": 3e-4,
           "ratio": 1 / 3, "low": 0.3, "high": 0.4}
    table = bench.format_table([row], markdown=True).splitlines()
    assert table[0].startswith("| transport | case | tandem | torch | ratio")
    assert "| auto | echo | 100 us | 300 us | 0.33 | 0.30-0.40 | <= 0.30 |" == table[2]


def test_unknown_transport_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--transports", "ibv"])
    assert exc.value.code == 2
