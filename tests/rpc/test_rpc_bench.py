"""Smoke test of ``python -m tandem.bench rpc --quick``: it runs both libraries and prints
a row per transport and case. Benchmarks are not timed tests: nothing here looks at the
numbers beyond their being positive."""

from __future__ import annotations

import mmap
import re
import subprocess
import sys

import pytest

from tandem.bench import rpc as bench

pytestmark = pytest.mark.timeout(300)


@pytest.mark.procs
def test_quick_bench_prints_every_case_against_torch() -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem.bench", "rpc", "--quick",
                           "--transports", "auto,tcp", "--per-round"], capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("machine: "), proc.stdout
    rows = [re.split(r"\s{2,}", ln.strip()) for ln in lines
            if ln.startswith(("auto", "tcp")) and " round " not in ln]
    assert [(r[0], r[1]) for r in rows] == [(t, c) for t in ("auto", "tcp")
                                            for c in bench.CASES], proc.stdout
    for row in rows:
        assert float(row[4]) > 0, row
    # --per-round: each of the quick run's 2 rounds of every row, with page faults
    rounds = [ln for ln in lines if " round " in ln]
    assert [ln.split(" round ")[0] for ln in rounds] == [
        f"{t} {c}" for t in ("auto", "tcp") for c in bench.CASES for _ in range(2)], proc.stdout
    for line in rounds:
        assert re.search(r"tandem .+ \(\d+\+\d+ faults/call\), torch .+ \(\d+\+\d+ "
                         r"faults/call\), ratio \d+\.\d\d$", line), line


def test_per_round_lines_show_both_figures_faults_and_ratio() -> None:
    row = {"transport": "auto", "case": "16 MB", "tandem": 6e-3, "torch": 18e-3, "ratio": 1 / 3,
           "low": 0.3, "high": 0.4,
           "rounds": [((6e-3, 0.0, 2.0), (18e-3, 4101.0, 3.0)), ((5e-3, 1.0, 0.0),
                                                                 (10e-3, 2.0, 0.0))]}
    assert bench.format_rounds([row]).splitlines() == [
        "auto 16 MB round 1: tandem 6.00 ms (0+2 faults/call), torch 18.00 ms (4101+3 "
        "faults/call), ratio 0.33",
        "auto 16 MB round 2: tandem 5.00 ms (1+0 faults/call), torch 10.00 ms (2+0 "
        "faults/call), ratio 0.50"]


def test_fault_count_sees_memory_touched_for_the_first_time() -> None:
    area = mmap.mmap(-1, 64 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    before = bench._faults()
    for page in range(64):
        area[page * mmap.PAGESIZE] = 1
    touched = bench._faults() - before
    again = bench._faults()
    for page in range(64):
        area[page * mmap.PAGESIZE] = 2
    assert touched >= 64 and bench._faults() - again < 64, (touched, bench._faults() - again)
    area.close()


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
