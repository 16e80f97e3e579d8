"""Smoke test of ``python -m tandem.bench recovery --quick``: each way of taking a
SIGKILLed rank runs on the main example and the table has a row for it.

Nothing here looks at the figures beyond their being positive and the ratio being
present: they are the benchmark's to report (README), not a test's to bound.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.procs

HEADER = ["ranks", "mode", "resume", "time lost (full size)", "ratio", "redone steps",
          "work lost"]


@pytest.mark.timeout(400)
def test_quick_recovery_bench_prints_a_row_per_mode() -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem.bench", "recovery", "--quick",
                           "--warmup", "10"], capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("ranks "))
    # columns are separated by two or more spaces; restart's ratio cell is empty
    table = [re.split(r"\s{2,}", ln.strip()) for ln in lines[start:]]
    assert table[0] == HEADER, proc.stdout
    rows = {r[1]: r for r in table[1:]}
    assert set(rows) == {"restart", "in-place", "cold", "spare"}, proc.stdout
    for mode, row in rows.items():
        resume, full = (float(row[i].split()[0]) for i in (2, 3))
        assert row[0] == "2" and 0 < resume <= full, (mode, proc.stdout)
    for mode in ("in-place", "cold", "spare"):
        assert float(rows[mode][4]) > 0, (mode, proc.stdout)  # the ratio to restart's
