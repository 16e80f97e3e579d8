"""Failures at 32 ranks: a SIGKILLed rank named by every survivor within 5 s; a stopped
rank named alone by the stall report, in its first report.

The kill runs on 4 simulated hosts x 8 ranks, so survivors on the dead rank's host (shared
memory) and on the other hosts (TCP) both have to notice; the stall on one host x 32.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

import _scale_ranks
from tandem.bench import _scale_failures
from tandem.bench.scale import _ranks_in
from tandem.testing import launch
from test_scale_ranks import hosts

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]

NOTICED_WITHIN = 5.0  # seconds from the kill to each survivor's error
VICTIM = 13  # host 1 of 4, neither a host's first rank nor the last
STALL = 1.0  # TANDEM_STALL_WARN
OP_S = 8.0  # the stalled call's deadline: reports come long before it


def test_a_killed_rank_is_named_by_every_survivor_within_5_s() -> None:
    with tempfile.TemporaryDirectory(prefix="tandem-scale-") as tmp:
        stamp = f"{tmp}/killed"
        with hosts(4, Path(tmp)) as (names, addrs):
            outcomes = launch(32, _scale_failures.killed, (f"{tmp}/store", names, addrs, 8,
                                                           VICTIM, stamp, 60.0),
                              init=False, timeout=100)
        killed_at = float(Path(stamp).read_text())
    assert outcomes[VICTIM].exitcode == -9, outcomes[VICTIM]
    bad = [o for o in outcomes if o.rank != VICTIM and not o.ok]
    assert not bad, "\n".join(f"--- rank {o.rank} ---\n{o.error[-2000:]}" for o in bad[:3])
    got = {o.rank: o.value for o in outcomes if o.rank != VICTIM}
    wrong = {r: v for r, v in got.items()
             if v["type"] != "PeerLostError" or f"rank {VICTIM}" not in v["msg"]}
    assert not wrong, wrong
    late = {r: round(v["at"] - killed_at, 2) for r, v in got.items()
            if v["at"] - killed_at > NOTICED_WITHIN}
    assert not late, f"seconds from the kill to the error: {late}"


def test_a_stopped_rank_is_named_alone_in_the_first_stall_report() -> None:
    with tempfile.TemporaryDirectory(prefix="tandem-scale-") as tmp:
        outcomes = launch(32, _scale_failures.stalled, (f"{tmp}/store", [], [], 32, VICTIM, OP_S),
                          init=False, timeout=100, env={"TANDEM_STALL_WARN": str(STALL)})
    assert outcomes[VICTIM].error_type == "stopped", outcomes[VICTIM]
    bad = [o for o in outcomes if o.rank != VICTIM and not o.ok]
    assert not bad, "\n".join(f"--- rank {o.rank} ---\n{o.error[-2000:]}" for o in bad[:3])
    # reports of the stalled call only (the first call may be reported while ranks join)
    reports: dict[int, Any] = {o.rank: [(t, m) for t, m in o.value if "all_reduce #1 " in m]
                               for o in outcomes if o.rank != VICTIM}
    silent = [r for r, v in reports.items() if not v]
    assert not silent, f"ranks that waited {OP_S:.0f} s without a stall report: {silent}"
    for rank, values in reports.items():
        took, first = values[0]
        named = [r for line in re.findall(r"^  ranks? ([\d, -]+) ha(?:s|ve) not arrived", first,
                                          re.MULTILINE) for r in _ranks_in(line)]
        assert named == [VICTIM], f"rank {rank}'s first report ({took:.1f} s):\n{first}"
        assert took < OP_S, (rank, took)


def test_a_rank_that_exits_after_a_failure_tells_its_peers_why() -> None:
    # rank 1 learnt from rank 0 why the group failed, then its script ended (no
    # destroy_process_group): rank 2, waiting on rank 1, must get that reason, not "rank 1
    # died". At 8 hosts x 8, 23 of 64 ranks blamed ranks that had only exited.
    with tempfile.TemporaryDirectory(prefix="tandem-scale-") as tmp:
        outcomes = launch(3, _scale_ranks.relayed, (f"{tmp}/store", f"{tmp}/stamp"),
                          init=False, timeout=90)
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(f"--- rank {o.rank} ---\n{o.error[-2000:]}" for o in bad)
    got = outcomes[2].value
    assert "rank 0 gave up on purpose" in got["msg"], got


def test_a_script_that_raises_after_a_failure_tells_its_peers_why_at_exit(
        tmp_path: Path) -> None:
    # the same as plain processes: rank 1 raises and its interpreter exits (no
    # destroy_process_group); what it learnt reaches rank 2 through the atexit hook
    script = Path(_scale_ranks.__file__)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "store"),
                               str(tmp_path / "stamp"), str(tmp_path / f"out{r}")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, "TANDEM_SECRET": "scale-test-secret"})
             for r in range(3)]
    try:
        logs = [p.communicate(timeout=90)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert "rank 1 stops here" in logs[1], logs[1][-2000:]
    got = json.loads((tmp_path / "out2").read_text())
    assert "rank 0 gave up on purpose" in got["msg"], (got, logs[2][-2000:])
