"""``python -m tandem.bench scale``: its smoke mode runs and writes table, plot and figures;
its layouts parse; the resource counter it rests on counts what a process holds."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.bench._resources import snapshot
from tandem.bench._hosts import Layout
from tandem.bench.scale import parse_scale_layouts


def test_layouts_allow_one_host_and_need_two_ranks() -> None:
    assert parse_scale_layouts("1x8, 2x8,8x8") == [Layout(1, 8), Layout(2, 8), Layout(8, 8)]
    assert Layout(4, 8).placement[7:9] == [0, 1]
    for bad in ("1x1", "0x8", "2x0", "2by2", "", "x"):
        with pytest.raises(ValueError, match="layout"):
            parse_scale_layouts(bad)


def test_the_counter_sees_new_descriptors_and_connections_on_this_host() -> None:
    before = snapshot()
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        with client, accepted:
            grown = snapshot().minus(before)
    # both ends of the one connection are this process's, and both are on this host
    assert grown["local_tcp"] == 2 and grown["remote_tcp"] == 0, grown
    assert grown["fds"] == 3, grown  # listener, client, accepted


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_smoke_mode_writes_the_tables_the_plot_and_the_figures(tmp_path: Path) -> None:
    out = tmp_path / "scale.md"
    # no tandemrun/torchrun launches: they double the torch imports (the startup bench's
    # smoke test launches both)
    proc = subprocess.run([sys.executable, "-m", "tandem.bench", "scale", "--smoke",
                           "--launch-rounds", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=220)
    if "simulated hosts are unavailable" in proc.stdout:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-3000:]}"
    figures = json.loads(out.with_suffix(".json").read_text())
    assert [f["layout"] for f in figures] == ["1x2", "2x2"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = out.read_text()
    for f in figures:
        ops = [c["op"] for c in f["collectives"]]
        assert ops == ["all_reduce", "all_gather", "broadcast", "reduce_scatter", "barrier"], f
        assert all(c["tandem"] > 0 and c["gloo"] > 0 for c in f["collectives"]), f
        assert f["start"]["tandem"]["barrier"] >= f["start"]["tandem"]["init"] > 0, f
        assert f["resources"]["tandem"]["local_tcp"] == 0, f  # shared memory within a host
        assert f["launch"] is None, f
        assert f["first"] == "tandem", f  # tandem's start-up first unless --gloo-first
    assert "| op | size | 1x2 | 2x2 |" in text, text
    row = r"^\| all_reduce \| 4 KB \| [\d.]+ \(.* vs .*\) \| [\d.]+ \("  # speed-up (times)
    assert re.search(row, text, re.M), text
    # 2 hosts x 2 ranks: gloo's full mesh crosses hosts 2 times per rank, 4 per host
    assert figures[1]["resources"]["gloo"]["remote_tcp_per_host"] == 4, figures[1]


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_gloo_first_swaps_the_start_ups_and_keeps_each_library_s_resources(
        tmp_path: Path) -> None:
    """The library started first pays the process's first uses: ``--gloo-first`` swaps
    the order, and each library's descriptors and connections are still its own."""
    out = tmp_path / "scale.md"
    proc = subprocess.run([sys.executable, "-m", "tandem.bench", "scale", "--layouts", "1x2",
                           "--ops", "barrier", "--sizes", "4K", "--rounds", "1",
                           "--round-ms", "10", "--wait", "0.3", "--launch-rounds", "0",
                           "--gloo-first", "--out", str(out)],
                          capture_output=True, text=True, timeout=220)
    if "simulated hosts are unavailable" in proc.stdout:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "gloo started first" in out.read_text()
    f = json.loads(out.with_suffix(".json").read_text())[0]
    assert f["first"] == "gloo", f
    assert f["start"]["tandem"]["barrier"] >= f["start"]["tandem"]["init"] > 0, f
    assert f["resources"]["tandem"]["local_tcp"] == 0, f  # shared memory within a host
    assert f["resources"]["gloo"]["local_tcp"] >= 1, f  # gloo's own loopback connection


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_store_mode_prints_both_stores_rates_and_their_ratio() -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem.bench", "scale", "--store", "2",
                           "--store-ops", "20", "--rounds", "2"],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-3000:]}"
    got = re.search(r"tandem TCPStore (\d+) ops/s, torch TCPStore (\d+) ops/s, ratio "
                    r"tandem/torch ([\d.]+)", proc.stdout)
    assert got and int(got.group(1)) > 0 and int(got.group(2)) > 0, proc.stdout


def test_a_benchmark_inside_the_package_is_the_call_site_reports_name() -> None:
    # a mismatch or stall seen by `scale --failures` names the benchmark's own line, not
    # the multiprocessing or runpy frame that called it
    import tandem.bench
    from tandem.collectives.api import call_site
    from tandem.collectives.stall_report import frame_site

    name = str(Path(tandem.bench.__file__).with_name("a_caller.py"))
    space: dict[str, object] = {"call_site": call_site, "sys": sys, "frame_site": frame_site}
    exec(compile("\n\nsite = call_site()\nframe = frame_site(sys._getframe())\n", name, "exec"),
         space)
    assert space["site"] == "a_caller.py:3", space["site"]
    assert space["frame"] == "a_caller.py:4 in <module>", space["frame"]


def test_errors_about_a_64_rank_group_name_its_ranks_in_a_few_characters() -> None:
    # a collective's failure, a bad rank argument and a non-member's call all name the
    # group's ranks: at 64 ranks a list of 64 numbers filled the message (seen in every
    # survivor's PeerLostError at 8 hosts x 8)
    from tandem._words import in_order
    from tandem.collectives.group import NonMemberGroup

    assert in_order(range(64)) == "[0-63]"
    assert in_order([4, 1, 2, 3, 9]) == "[4, 1-3, 9]" and in_order([]) == "[]"
    message = str(NonMemberGroup(list(range(64)), "big", 70).error("all_reduce"))
    assert "(global ranks [0-63]) but is not a member" in message, message


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_failures_smoke_mode_checks_the_four_scenarios(tmp_path: Path) -> None:
    out = tmp_path / "failures.md"
    proc = subprocess.run([sys.executable, "-m", "tandem.bench", "scale", "--failures",
                           "--smoke", "--stall-warn", "1", "--op-timeout", "8",
                           "--out", str(out)], capture_output=True, text=True, timeout=280)
    if "simulated hosts are unavailable" in proc.stdout:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-3000:]}"
    figures = json.loads(out.with_suffix(".json").read_text())
    assert [f["layout"] for f in figures] == ["2x2"], figures
    got = figures[0]["scenarios"]
    assert list(got) == ["kill", "stall", "skip", "summary"], got
    failed = {k: v["detail"] for k, v in got.items() if not v["held"]}
    assert not failed, failed
    assert got["summary"]["lines"] <= 40 and "rank       : 3 " in got["summary"]["text"]
    assert "_scale_failures.py:" in got["skip"]["named"], got["skip"]
    assert re.search(r"^\| 2x2 \| kill \| .* \| yes \| [\d.]+ \|", out.read_text(), re.M)
