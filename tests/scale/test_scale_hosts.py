"""Benchmark ranks on simulated hosts (``tandem.bench._hosts``): each host's ranks are
forked from one zygote that imported torch, and a run whose ranks fail names the rank
that ended first, how it ended (exit code, signal, the OOM killer) and what it printed.

At 8 hosts x 8, 64 ranks each importing torch peaked at 13.5 GB, so the scale
benchmark's 16 MB sizes did not fit in 14 GB; and when rank 48 died in the 53rd
16 MB reduce, every survivor named it but its own end was nowhere in the error.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import pytest

import _host_ranks
from tandem.bench._hosts import Hosts, Layout, RankEnd, describe_failures
from tandem.testing import wait_until
from tandem.testing.links import LinkShape
from tandem.testing.netns import RankRun, Unavailable, netns_lab

pytestmark = pytest.mark.procs

_ENV = {"PYTHONPATH": str(Path(__file__).parent)}


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    with tempfile.TemporaryDirectory(prefix="tandem-test-hosts-") as tmp:
        try:
            with netns_lab(2, Path(tmp), LinkShape()) as lab:
                yield Hosts(lab, Layout(2, 2))
        except Unavailable as exc:
            pytest.skip(str(exc))


@pytest.mark.timeout(180)
def test_a_hosts_ranks_are_forked_from_one_zygote_and_share_its_pages(hosts: Hosts) -> None:
    got = hosts.run(_host_ranks.where, (), timeout=150, env=_ENV, zygote=True)
    parents = [g["ppid"] for g in got]
    # one parent per host, not the lab (ranks started as interpreters are the lab's children)
    assert parents[0] == parents[1] != parents[2] == parents[3] != os.getpid(), got
    assert [g["host"] for g in got] == ["labhost0", "labhost0", "labhost1", "labhost1"], got
    for g in got:
        # a rank that imported torch itself holds all its anonymous memory alone (PSS =
        # RSS); a forked one shares torch's with its zygote and its sibling (~1/3 each)
        assert g["anon_pss_kb"] < 0.6 * g["anon_kb"], g


def _failure(hosts: Hosts, how: str) -> str:
    """The error of a run in which rank 1 dies ``how`` (and rank 2 fails after it)."""
    with pytest.raises(RuntimeError) as got:
        hosts.run(_host_ranks.dies, (str(hosts.workdir), how), timeout=150, env=_ENV,
                  zygote=True)
    return str(got.value)


@pytest.mark.timeout(180)
def test_a_rank_killed_by_a_signal_is_named_first_with_its_signal(hosts: Hosts) -> None:
    text = _failure(hosts, "kill")
    assert "2 of 4 ranks failed on 2x2 hosts" in text, text
    assert "first to end: rank 1 on host 0, killed by SIGKILL (signal 9)" in text, text
    assert "--- rank 1 on host 0: killed by SIGKILL (signal 9) ---\nrank 1 was here" in text
    assert "--- rank 2 on host 1: exit 1 ---" in text and "rank 2 saw rank 1 go" in text, text
    assert "memory cgroup " in text and "OOM kills during the run" in text, text


@pytest.mark.timeout(180)
def test_a_rank_that_raised_is_named_with_its_traceback(hosts: Hosts) -> None:
    text = _failure(hosts, "raise")
    assert "first to end: rank 1 on host 0, exit 1" in text, text
    assert "ValueError: rank 1 broke on purpose" in text, text
    assert "_host_ranks.py" in text, text  # the traceback, not only the message


def _memory_cgroup_v1() -> Path:
    root = Path("/sys/fs/cgroup/memory")
    if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
        pytest.skip("needs a writable cgroup v1 memory hierarchy")
    return root


@pytest.mark.timeout(180)
def test_a_rank_the_oom_killer_ended_is_named_with_the_kernels_line(hosts: Hosts) -> None:
    cgroup = _memory_cgroup_v1() / f"tandem-test-oom-{os.getpid()}"
    cgroup.mkdir()
    workdir = hosts.workdir

    def move() -> None:  # the rank's namespace has its own /sys, without cgroups
        wait_until(lambda: (workdir / "oom-pid").exists(), "rank 1's pid", timeout=120)
        (cgroup / "cgroup.procs").write_text((workdir / "oom-pid").read_text())
        (workdir / "oom-moved").touch()

    mover = threading.Thread(target=move, daemon=True)
    try:
        (cgroup / "memory.limit_in_bytes").write_text(str(64 << 20))
        (cgroup / "memory.swappiness").write_text("0")
        mover.start()
        text = _failure(hosts, "oom")
    finally:
        mover.join(5)
        cgroup.rmdir()  # empty: its one process was killed
    assert "first to end: rank 1 on host 0, killed by SIGKILL (signal 9); the kernel's OOM " \
           "killer: " in text, text
    assert "Killed process " in text, text


def test_an_interpreter_ranks_signal_is_read_from_its_negative_return_code() -> None:
    killed = RankEnd.of(RankRun(5, 1, -9, "", 1234, 10.0))
    assert (killed.exit, killed.signal, killed.how()) == (None, 9, "killed by SIGKILL (signal 9)")
    assert RankEnd.of(RankRun(0, 0, 2, "", 1, 9.0)).how() == "exit 2"
    assert "never ended" in RankEnd.of(RankRun(0, 0, None, "", 1, None)).how()
    # the first to end is named first however the ranks are numbered; the rest briefly
    ends = [RankEnd(r, r // 8, 100 + r, 1, None, 50.0 + r, f"rank {r} saw a peer go")
            for r in range(64)]
    ends[48] = RankEnd(48, 6, 148, None, signal.SIGSEGV, 20.0, "")
    text = describe_failures("8x8", ends, [], None, None)
    assert text.splitlines()[:3] == [
        "64 of 64 ranks failed on 8x8 hosts",
        "first to end: rank 48 on host 6, killed by SIGSEGV (signal 11)",
        "--- rank 48 on host 6: killed by SIGSEGV (signal 11) ---"], text
    assert "(it printed nothing)" in text and len(text.splitlines()) < 30, text
