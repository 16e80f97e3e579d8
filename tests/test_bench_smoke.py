"""Smoke test of ``python -m tandem.bench collectives --quick``: it runs and prints a table.

Run: ``python -m pytest tests/test_bench_smoke.py``. Benchmarks are not timed tests,
so nothing here looks at the numbers beyond their being positive.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.procs

NUMBER = re.compile(r"^(\d+(?:\.\d+)?)(?: MB/s|%)?")


def _bench(*args: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "tandem.bench", "collectives", "--quick", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert any(ln.startswith("machine: ") for ln in lines), proc.stdout
    return lines


def _table(lines: list[str], markdown: bool) -> list[dict[str, str]]:
    """The table's rows as {column: cell}; columns are split on two or more spaces or |."""
    if markdown:
        rows = [[c.strip() for c in ln.strip().strip("|").split("|")]
                for ln in lines if ln.startswith("|") and "---" not in ln]
    else:
        start = next(i for i, ln in enumerate(lines) if ln.startswith("ranks "))
        rows = [re.split(r"\s{2,}", ln.strip()) for ln in lines[start:]]
    header, *body = rows
    assert all(len(r) == len(header) for r in body), "\n".join(lines)
    return [dict(zip(header, r)) for r in body]


def _positive(row: dict[str, str], column: str) -> None:
    m = NUMBER.match(row[column])
    assert m and float(m.group(1)) > 0, f"{row['size']} {column}: {row[column]!r} is not positive"


def _check_rows(rows: list[dict[str, str]], backends: list[str]) -> None:
    assert [(r["ranks"], r["op"], r["size"]) for r in rows] == \
        [("2", "all_reduce", "4 KB"), ("2", "all_reduce", "1 MB")], rows
    for row in rows:
        for column in ["gloo busbw", "bound busbw", "best/bound",
                       *(f"{b} {c}" for b in backends for c in ("busbw", "ratio"))]:
            _positive(row, column)
        assert row["best/bound"].endswith(tuple(f"({b})" for b in backends)), row


def test_quick_bench_prints_each_backend_against_gloo_and_the_copy_bound() -> None:
    lines = _bench()
    rows = _table(lines, markdown=False)
    skipped = [ln for ln in lines if ln.startswith("skipped ")]
    if skipped:  # shared memory unsupported here: only tcp ran, and the reason is printed
        assert "shm" in skipped[0] and "auto" in skipped[0], skipped
        _check_rows(rows, ["tcp"])
        assert "shm busbw" not in rows[0], rows[0]
    else:
        _check_rows(rows, ["tcp", "shm", "auto"])


def test_backend_alias_runs_one_backend_and_markdown_keeps_the_columns() -> None:
    rows = _table(_bench("--backend", "tcp", "--markdown"), markdown=True)
    _check_rows(rows, ["tcp"])
    assert not any(c.startswith(("shm", "auto")) for c in rows[0]), rows[0]


def test_rooted_ops_run_checked_against_gloo_with_their_bound() -> None:
    from tandem.transport.shm import unsupported_reason

    if unsupported_reason():
        pytest.skip(f"shared memory is unsupported here: {unsupported_reason()}")
    # each row's op runs once on known values first; a wrong result fails the bench
    rows = _table(_bench("--backend", "shm", "--ops", "reduce,broadcast", "--markdown"),
                  markdown=True)
    assert [(r["op"], r["size"]) for r in rows] == [
        ("reduce", "4 KB"), ("reduce", "1 MB"), ("broadcast", "4 KB"), ("broadcast", "1 MB")], rows
    for row in rows:
        for column in ("gloo busbw", "shm busbw", "shm ratio", "bound busbw", "best/bound"):
            _positive(row, column)


@pytest.mark.smoke("tandem.bench")
def test_bench_without_a_command_exits_with_usage() -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem.bench"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "collectives" in proc.stderr


def test_the_recorder_benchmark_prints_both_modes_and_the_share() -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem.bench", "recorder", "--iters", "20",
                           "--rounds", "1", "--runs", "1", "--in-place-runs", "2"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    assert len(re.findall(r"in place: recording .* paired difference [+-]\d+\.\d\d us, adding up "
                          r"laps \d+\.\d\d us: [+-]\d+\.\d\d us = [+-]\d+\.\d%", out)) == 2, out
    assert re.search(r"in place, median of 2 runs: [+-]\d+\.\d% \((within|over) the 2% budget",
                     out), out
    for unit in ("wall time", "CPU time "):
        assert re.search(rf"{unit}: recording +\d+\.\d us .*, off +\d+\.\d us .*, overhead "
                         rf"[+-]\d+\.\d%", out), out
    assert re.search(r"recording work per call .*: \d+\.\d\d us = \d+\.\d\d% of the 4096 B", out)
    assert re.search(r"whole call path .*: [+-]\d+\.\d\d us per call .* of the 4096 B", out)


def test_quick_bench_across_shaped_simulated_hosts_prints_ratio_and_link_bound() -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem.bench", "collectives", "--quick",
                           "--link", "1gbit:0.2ms", "--ops", "all_reduce,all_gather"],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 1 and "simulated hosts are unavailable" in proc.stdout:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    link = next(ln for ln in lines if ln.startswith("2x1: link 1gbit:0.2ms"))
    assert re.search(r"one TCP stream \d+ Mbit/s, ping round trip median \d", link), link
    start = next(i for i, ln in enumerate(lines) if ln.startswith("hosts x ranks "))
    rows = [dict(zip(re.split(r"\s{2,}", lines[start].strip()), re.split(r"\s{2,}", ln.strip())))
            for ln in lines[start + 1:]]
    assert [(r["hosts x ranks"], r["op"], r["size"]) for r in rows] == [
        ("2x1", op, size) for op in ("all_reduce", "all_gather") for size in ("4 KB", "1 MB")]
    for row in rows:
        for column in ("auto ratio", "auto/bound", "gloo/bound"):
            _positive(row, column)
    # 1 MB all-reduce over 2 hosts: each must send 1 MB at 125 MB/s
    assert rows[1]["link bound"] == "8.4 ms", rows[1]


def test_the_store_benchmark_runs_both_stores_without_failures() -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem.bench", "store", "--clients", "4",
                           "--ops", "30", "--markdown"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["store"]: r for r in _table(proc.stdout.splitlines(), markdown=True)}
    assert set(rows) == {"tandem", "torch"}, proc.stdout
    for row in rows.values():
        assert row["failed"] == "0" and float(row["ops/s"]) > 0, row
    assert "failed, e.g." not in proc.stdout


def test_the_latency_benchmark_prints_every_op_per_backend() -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem.bench", "latency", "--iters", "4",
                           "--rounds", "1", "--runs", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout}\n{proc.stderr}"
    from tandem.bench.latency import OPS

    for name in OPS:
        assert re.search(rf"^{name} +\d+\.\d +\d+\.\d$", proc.stdout, re.M), proc.stdout


def test_the_latency_benchmark_names_an_unknown_op() -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem.bench", "latency", "--ops", "scater"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--ops: unknown ['scater']" in proc.stderr and "scatter" in proc.stderr


@pytest.mark.parametrize("bench,flag", [("collectives", "--ops"), ("ddp", "--models"),
                                        ("torch-backend", "--parts"), ("latency", "--ops"),
                                        ("scale", "--ops")])
def test_every_benchmark_names_an_unknown_choice_and_the_known_ones(bench: str, flag: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem.bench", bench, flag, "bogus"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"{flag}: unknown ['bogus']; choose from " in proc.stderr, proc.stderr
