"""Smoke test of ``python -m tandem.bench torch-backend --quick``: it runs and prints a table.

Benchmarks are not timed tests: nothing here looks at the numbers beyond their being
positive. Run the benchmark itself with ``python -m tandem.bench torch-backend``.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

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


def test_fsdp_line_gives_each_backends_collective_share_and_the_ceiling() -> None:
    # two ranks, two rounds; round 1 is the best for both contenders (slowest rank's wall)
    times = [{"wall": {"tandem": [0.20, 0.10], "gloo": [0.30, 0.16]},
              "collectives": {"tandem": [0.05, 0.02], "gloo": [0.10, 0.06]}},
             {"wall": {"tandem": [0.21, 0.11], "gloo": [0.31, 0.15]},
              "collectives": {"tandem": [0.03, 0.01], "gloo": [0.12, 0.04]}}]
    outside = bench._outside_collectives(times, rounds=2)
    # the longest time a rank spent outside collectives in the best round
    assert outside == pytest.approx({"tandem": 0.10, "gloo": 0.11})
    row = {"part": "fsdp", "what": "transformer", "world": 2, "outside": outside,
           "wall": {"tandem": 0.11, "gloo": 0.16}, "cpu": {"tandem": 0.1, "gloo": 0.1}}
    line = bench.collectives_line(row)
    assert line.startswith("fsdp step (transformer), time in collectives:"), line
    assert "gloo 50.00 ms of 160.00 ms (31%)" in line, line
    assert "tandem 10.00 ms of 110.00 ms (9%)" in line, line
    assert "would take 100.00 ms, a ceiling of 1.60x gloo (speed-up now 1.45x)" in line, line


def test_collective_clock_times_torchs_functions_and_puts_them_back() -> None:
    import torch.distributed as dist

    from tandem.bench.torch_backend_rounds import CollectiveClock

    original = dist.all_gather_single
    with CollectiveClock(["all_gather_single"]) as clock:
        assert dist.all_gather_single is not original
        with pytest.raises(Exception):  # no default group: the call fails, and still counts
            dist.all_gather_single(torch.empty(2), torch.empty(1))
    assert dist.all_gather_single is original
    assert clock.calls == 1 and clock.seconds > 0


def test_unknown_part_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--parts", "rpc"])
    assert exc.value.code == 2


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_quick_run_prints_every_part_against_gloo() -> None:
    parts = "all_reduce,coalesced,ddp,fsdp,fsdp-short"
    proc = subprocess.run([sys.executable, "-m", "tandem.bench", "torch-backend", "--quick",
                           "--parts", parts], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert any(ln.startswith("machine: ") for ln in lines), proc.stdout
    start = next(i for i, ln in enumerate(lines) if ln.startswith("ranks "))
    rows = [re.split(r"\s{2,}", ln.strip()) for ln in lines[start + 1:start + 6]]
    assert [r[1] for r in rows] == ["all_reduce", "coalesced", "ddp step", "fsdp step",
                                    "fsdp step"], proc.stdout
    assert rows[3][2].endswith("8 x 64 tokens") and rows[4][2].endswith("1 x 64 tokens"), rows
    for row in rows:
        speed_up = float(row[5])
        assert speed_up > 0, row
    assert lines[start + 6].startswith("torch layer per call"), proc.stdout
    shares = lines[start + 7:start + 9]
    assert all(ln.startswith("fsdp step (") and "a ceiling of" in ln for ln in shares), \
        proc.stdout
