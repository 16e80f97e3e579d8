"""What a person reads from tandemrun: one failure, one traceback; Ctrl-C, one line per
rank at most; what every rank prints alike, once.

Measured before this was written (``python -m tandem.run --nproc-per-node 2
mismatch.py``; Ctrl-C, SIGINT to the launcher's process group as a terminal sends it,
during ``--nproc-per-node 4 examples/train_chars.py --quick --steps 300``): 98 lines
for the mismatch, 252 for Ctrl-C (a KeyboardInterrupt traceback per rank).
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Callable

import pytest

from runkit import SCRIPTS, Launch, Result, finish, wait_dead, wait_for_pids

pytestmark = pytest.mark.procs

Run = Callable[..., Result]
PREFIX = re.compile(r"^\[rank([0-9,-]+)\]: ")


def worker_lines(err: str) -> list[tuple[set[int], str]]:
    """The console lines that came from workers: (ranks, text)."""
    out = []
    for line in err.splitlines():
        m = PREFIX.match(line)
        if m:
            ranks: set[int] = set()
            for part in m.group(1).split(","):
                lo, _, hi = part.partition("-")
                ranks.update(range(int(lo), int(hi or lo) + 1))
            out.append((ranks, line[m.end():]))
    return out


@pytest.mark.timeout(90)
def test_a_mismatch_prints_one_traceback_and_a_summary_that_does_not_repeat_it(run: Run) -> None:
    res = run("--nproc-per-node", "2", SCRIPTS / "mismatch.py")
    assert res.code == 1
    assert res.err.count("Traceback (most recent call last)") == 1, res.err
    assert "inside tandem (TANDEM_DEBUG=1 shows them)" in res.err
    assert "tandem/collectives" not in res.err  # tandem's frames are folded
    summary = res.err[res.err.index("Root cause"):]
    root = re.search(r"rank       : (\d)", summary)
    assert root and f"traceback  : printed above by [rank{root.group(1)}]" in summary
    other = 1 - int(root.group(1))
    assert f"[rank{other}]: tandem.errors.CollectiveMismatchError at " in res.err
    assert "Stopped by the launcher" not in summary  # both failed of their own
    lines = res.err.splitlines()
    assert len(lines) <= 24, f"{len(lines)} lines:\n{res.err}"  # 98 before


@pytest.mark.timeout(120)
def test_ctrl_c_prints_at_most_one_line_per_rank(launch: Launch, tmp_path: Path) -> None:
    proc = launch("--nproc-per-node", "4", SCRIPTS / "all_reduce_forever.py", tmp_path)
    pids = wait_for_pids(tmp_path, 4, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
    res = finish(proc, 60)
    assert res.code == 128 + signal.SIGINT, res.err
    assert wait_dead(pids, 5) == []
    per_rank = {r: 0 for r in range(4)}
    for ranks, text in worker_lines(res.err):
        assert re.match(r"(KeyboardInterrupt|tandem\.errors\.PeerLostError) at ", text), res.err
        for r in ranks:
            per_rank[r] += 1
    assert max(per_rank.values()) <= 1, res.err
    assert "Traceback" not in res.err and "received SIGINT; workers stopped" in res.err
    launcher = [line for line in res.err.splitlines() if not PREFIX.match(line)]
    # start-up notes (the zygote's among them), the dumps, "received SIGINT"
    assert len(launcher) <= 5, res.err


@pytest.mark.timeout(60)
def test_help_and_argparse_errors_of_every_rank_appear_once(run: Run) -> None:
    res = run("--nproc-per-node", "3", SCRIPTS / "usage.py", "--help")
    assert res.code == 0, res.err
    assert res.out.count("usage: usage.py") == 1, res.out
    assert "[rank0-2]: usage: usage.py [-h] [--steps STEPS] [--lr LR]" in res.out
    assert re.search(r"^\[rank0-2\]:   --lr LR +the learning rate$", res.out, re.M), res.out

    res = run("--nproc-per-node", "3", SCRIPTS / "usage.py", "--bogus")
    assert res.code == 1
    assert res.err.count("error: unrecognized arguments: --bogus") == 1, res.err
    assert "[rank0-2]: usage.py: error: unrecognized arguments: --bogus" in res.err
    # the summary says the script exited by itself, not that it may have been killed
    assert "exit       : exit code 2" in res.err, res.err
    assert "the worker exited with status 2 itself (sys.exit, argparse" in res.err, res.err


@pytest.mark.timeout(60)
def test_tandem_debug_shows_every_ranks_whole_traceback(run: Run) -> None:
    res = run("--nproc-per-node", "2", SCRIPTS / "mismatch.py", env={"TANDEM_DEBUG": "1"})
    assert res.code == 1
    assert res.err.count("Traceback (most recent call last)") == 2
    assert "tandem/collectives/api.py" in res.err and "inside tandem" not in res.err
