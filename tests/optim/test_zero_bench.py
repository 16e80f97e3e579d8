"""The ZeRO benchmark's tables and command line, and one tiny run of every contender.

The benchmark itself (``python -m tandem.bench zero``) takes minutes; here the MLP is
32 wide and each contender runs one step, so this only shows that it runs and
reports sensible figures. Nothing looks at timings beyond their being positive.
"""

from __future__ import annotations

import tempfile

import pytest

from tandem.bench import zero as bench
from tandem.bench.ddp import _spawn_here


def test_time_table_has_a_row_and_ratios_per_contender() -> None:
    times = {2: {"torch zero": (0.120, 0.2), "zero": (0.060, 0.1), "zero2": (0.040, 0.1),
                 "zero2+overlap": (0.080, 0.4)}}
    lines = bench.format_time(times).splitlines()
    assert lines[0].split()[:4] == ["ranks", "contender", "step", "ratio"]
    zero2 = next(ln.split() for ln in lines if ln.split()[1] == "zero2")
    assert zero2[4] == "3.00" and zero2[-1] == "2.00", zero2
    assert bench.format_time(times, markdown=True).startswith("| ranks |")


def test_memory_table_compares_each_contender_with_its_librarys_plain_ddp() -> None:
    def m(state: int, grads: int) -> dict[str, int]:
        return {"state": state << 20, "grads": grads << 20, "peak": 100 << 20}

    memory = {2: {"torch ddp": m(64, 32), "torch zero": m(32, 32), "ddp": m(64, 32),
                  "zero": m(32, 32), "zero2": m(32, 16)}}
    rows = [ln.split() for ln in bench.format_memory(memory).splitlines()[1:]]
    zero2 = next(r for r in rows if r[1] == "zero2")
    assert zero2[2:4] == ["32.0", "MiB"] and zero2[4] == "0.500" and zero2[7] == "0.500", zero2


def test_usage_errors_exit_with_status_2() -> None:
    for argv in (["--world-sizes", "1"], ["--memory-world-sizes", "two"], ["--steps", "0"]):
        with pytest.raises(SystemExit) as exc:
            bench.main(argv)
        assert exc.value.code == 2, argv


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_every_contender_runs_a_step_and_reports_memory() -> None:
    times = bench.run_time(2, warmup=0, steps=1, rounds=1, width=32, timeout=200)
    assert set(times) == set(bench.TIMED), times
    assert all(wall > 0 and cpu > 0 for wall, cpu in times.values()), times
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = _spawn_here(2, bench._memory_main, ("zero2", f"file://{tmp}/m", 1, False, 32), 200)
    params = sum(p.numel() for p in bench.build(32)[0].parameters())
    for r in per_rank:
        # Adam: two moments per element of the rank's shard; sharded gradients: its shard
        assert 0 < r["grads"] < params * 4 and r["state"] >= 2 * r["grads"], per_rank
