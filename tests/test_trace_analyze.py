"""``python -m tandem.trace DIR`` names who called something different, who is behind and
who died, from dumps written here by hand (the fault tests use real ones)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem.trace.analyze import report

T0 = 1_800_000_000.0


def call(seq: int, op: str = "all_reduce", sig: str = "", site: str = "train.py:42",
         state: str = "completed", error: str = "", **extra: Any) -> dict[str, Any]:
    return {"seq": seq, "op": op, "sig": sig or f"{op} float32[4] op=SUM", "site": site,
            "bytes": 16, "peer": extra.get("peer", -1), "tag": extra.get("tag", 0),
            "state": state, "queued": T0 + seq, "started": T0 + seq,
            "ended": None if state == "started" else T0 + seq + 0.001,
            "duration_ms": None if state == "started" else 1.0, "error": error}


def dump(tmp: Path, rank: int, calls: list[dict[str, Any]], issued: int, world: int = 3,
         job: str = "job1", lost: dict[str, str] | None = None, main: str = "train.py:57 in load",
         at: float = T0 + 100) -> None:
    data = {"format": "tandem-flight-recorder", "version": 1, "rank": rank, "world_size": world,
            "job": job, "pid": 100 + rank, "host": "h", "time": at, "reason": "test",
            "reasons": ["test"], "main_thread": main, "stack": [main], "lost": lost or {},
            "groups": [{"id": 0, "name": "default", "ranks": list(range(world)),
                        "issued": issued, "aborted": "", "calls": calls}]}
    (tmp / f"rank{rank}.json").write_text(json.dumps(data))


def test_a_rank_that_never_issued_the_call_is_behind_and_its_place_is_named(tmp_path: Path) -> None:
    waiting = [call(0), call(1, state="started")]
    dump(tmp_path, 0, waiting, 2)
    dump(tmp_path, 1, waiting, 2)
    dump(tmp_path, 2, [call(0)], 1, main="train.py:57 in load_batch")
    text = "\n".join(report(str(tmp_path)))
    assert "call #1: rank 2 is behind" in text, text
    assert "ranks 0-1 are in all_reduce float32[4] op=SUM at train.py:42 (waiting 99.0 s" in text
    assert "rank 2: last call #0 all_reduce at train.py:42 (completed); not in a collective; " \
           "main thread at train.py:57 in load_batch" in text, text


def test_ranks_that_called_different_collectives_are_named_with_both_calls(tmp_path: Path) -> None:
    dump(tmp_path, 0, [call(0), call(1, state="failed", error="CollectiveMismatchError: x")], 2)
    dump(tmp_path, 1, [call(0), call(1, "broadcast", "broadcast float32[4] root=0", "train.py:50",
                                      state="failed", error="CollectiveMismatchError: y")], 2)
    dump(tmp_path, 2, [call(0), call(1, state="failed", error="CollectiveMismatchError: x")], 2)
    lines = report(str(tmp_path))
    start = next(i for i, ln in enumerate(lines) if "called different collectives" in ln)
    assert "group 'default' (ranks 0-2), call #1" in lines[start], lines
    assert lines[start + 1:start + 3] == [
        "  ranks 0, 2: all_reduce float32[4] op=SUM at train.py:42",
        "  rank 1: broadcast float32[4] root=0 at train.py:50"], lines


def test_a_rank_without_a_dump_that_peers_lost_died(tmp_path: Path) -> None:
    failed = call(3, state="failed", error="PeerLostError: rank 2 closed its connection")
    lost = {"2": "rank 2 (pid 9, host h) closed its connection to rank 0"}
    dump(tmp_path, 0, [call(2), failed], 4, lost=lost)
    dump(tmp_path, 1, [call(2), failed], 4, lost=lost)
    text = "\n".join(report(str(tmp_path)))
    assert "rank 2 died: no dump; ranks 0-1 lost it: rank 2 (pid 9, host h) closed" in text, text
    assert "ranks 0-1: all_reduce #3 on group 'default' at train.py:42 failed: PeerLostError" in text
    assert "recorded calls agree" in text, text


def test_only_calls_every_rank_still_remembers_are_compared(tmp_path: Path) -> None:
    # rank 0's ring no longer holds #0-#4; rank 1's does: no false divergence there
    dump(tmp_path, 0, [call(s) for s in range(5, 8)], 8, world=2)
    dump(tmp_path, 1, [call(s, sig="broadcast float32[4] root=0" if s < 5 else "")
                       for s in range(8)], 8, world=2)
    assert "recorded calls agree" in "\n".join(report(str(tmp_path)))


def test_a_dump_written_before_its_rank_learnt_the_job_id_is_kept(tmp_path: Path) -> None:
    # a mismatch right after init: rank 0 dumps before its watchdog read the job's id
    dump(tmp_path, 0, [call(1, state="failed", sig="all_reduce float32[4] sum")], 2, world=2,
         job="", at=T0 + 1)
    dump(tmp_path, 1, [call(1, state="failed", sig="broadcast float32[4] root=0")], 2, world=2,
         job="abc", at=T0)
    text = "\n".join(report(str(tmp_path)))
    assert "another job" not in text, text
    assert "called different collectives" in text, text


def test_dumps_of_another_job_in_the_directory_are_left_out(tmp_path: Path) -> None:
    dump(tmp_path, 0, [call(0), call(1, state="started")], 2, world=2, job="new", at=T0 + 100)
    dump(tmp_path, 1, [call(0)], 1, world=2, job="old", at=T0 - 1000)
    text = "\n".join(report(str(tmp_path)))
    assert "left out the dumps of rank 1: they belong to another job" in text, text
    assert "rank 1 wrote no dump" in text, text


def test_waiting_sends_and_receives_are_listed(tmp_path: Path) -> None:
    dump(tmp_path, 0, [call(-1, "recv", "", "pipe.py:9", state="started", peer=1, tag=5)], 0,
         world=2)
    dump(tmp_path, 1, [], 0, world=2)
    assert ("rank 0 waits in recv from rank 1 (tag 5) at pipe.py:9 (waiting 101.0 s at the dump)"
            in report(str(tmp_path)))


@pytest.mark.smoke("tandem.trace")
@pytest.mark.procs
def test_the_command_line_prints_the_report_and_fails_without_dumps(tmp_path: Path) -> None:
    empty = subprocess.run([sys.executable, "-m", "tandem.trace", str(tmp_path)],
                           capture_output=True, text=True, timeout=60)
    assert empty.returncode == 1 and "no flight-recorder dumps" in empty.stdout, empty
    dump(tmp_path, 0, [call(0)], 1, world=1)
    ok = subprocess.run([sys.executable, "-m", "tandem.trace", str(tmp_path)],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "flight recorders of rank 0 (1 of 1)" in ok.stdout, ok


@pytest.mark.procs
def test_reading_dumps_and_timelines_does_not_import_torch() -> None:
    code = ("import sys, tandem.trace.__main__, tandem.run.dumps; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "False"


def test_when_all_agree_each_rank_says_where_it_was(tmp_path: Path) -> None:
    # e.g. dumps taken with SIGUSR1 of a job hung outside tandem's calls
    dump(tmp_path, 0, [call(0)], 1, world=2, main="train.py:9 in wait_for_file")
    dump(tmp_path, 1, [call(0)], 1, world=2, main="train.py:9 in wait_for_file")
    lines = report(str(tmp_path))
    assert lines[1:] == [
        "the ranks' recorded calls agree on every group",
        "ranks 0-1: last call all_reduce at train.py:42 (completed); not in a collective; "
        "main thread at train.py:9 in wait_for_file"], lines


def test_dumps_of_an_earlier_moment_are_left_out_with_their_time(tmp_path: Path) -> None:
    # rank 1's dump is from an earlier SIGUSR1; rank 0 dumped later, further on
    dump(tmp_path, 0, [call(0), call(1), call(2, state="started")], 3, world=2, at=T0 + 300)
    dump(tmp_path, 1, [call(0)], 1, world=2, at=T0 + 100)
    text = "\n".join(report(str(tmp_path)))
    assert "rank 1 is behind" not in text, text
    assert "left out the older dumps of rank 1 (written " in text, text
    assert "ranks dumped at different moments look behind only because their dump is older" \
        in text
    assert "flight recorders of rank 0 (1 of 2)" in text
    # dumps of one event, seconds apart, are compared as before
    dump(tmp_path, 1, [call(0)], 1, world=2, at=T0 + 297)
    assert "call #1: rank 1 is behind" in "\n".join(report(str(tmp_path)))
