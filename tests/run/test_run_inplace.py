"""The launcher's in-place recovery for jobs under ``tandem.elastic.run_elastic``: a
SIGKILLed worker is replaced while the survivors go on in the same processes; spares;
a slot that keeps failing gets a back-off and a limit; the minimum; two nodes; no
orphans (the launcher's zygote included); the summary names every failure."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from runkit import SCRIPTS, Launch, Result, finish, process_alive, wait_dead
from test_run_multinode import SECRET, free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "elastic"))
from _elastic_job import check_against_oracle  # noqa: E402

pytestmark = pytest.mark.procs

Run = Callable[..., Result]
TRAIN = SCRIPTS / "elastic_train.py"


def _names(out: Path) -> dict[str, int]:
    return {p.name[5:]: int(p.read_text()) for p in out.glob("name_*")}


def zygotes(err: str) -> list[int]:
    """The pids of the launchers' zygotes (``tandem.run.warm``), from their ready lines."""
    return [int(p) for p in re.findall(r"warm starts ready: a zygote \(pid (\d+)\)", err)]


def _results(out: Path) -> dict[str, dict[str, Any]]:
    return {p.name[7:-3]: torch.load(p, weights_only=True) for p in out.glob("result_*.pt")}


def _check(results: dict[str, dict[str, Any]], steps: int) -> list[int]:
    """Every finisher applied the same ``steps`` steps, once each, to the oracle's
    parameters; the world size of each step."""
    history = check_against_oracle(list(results.values()))
    assert len(history) == steps, history
    return [w for _, w, _ in history]


@pytest.mark.timeout(180)
def test_a_killed_worker_is_replaced_while_the_others_go_on(run: Run, tmp_path: Path) -> None:
    res = run("--standalone", "--nproc-per-node", "3", "--max-restarts", "2", TRAIN, tmp_path,
              30, "--kill", "1:7", "--wait-full", "20", "--full", "3", timeout=150)
    assert res.code == 0, res.err
    names, results = _names(tmp_path), _results(tmp_path)
    assert set(names) == {"n0.s0.0", "n0.s1.0", "n0.s2.0", "n0.s1.1"}, names
    assert set(results) == {"n0.s0.0", "n0.s2.0", "n0.s1.1"}, "the survivors or the joiner"
    for survivor in ("n0.s0.0", "n0.s2.0"):  # the same processes from start to end
        assert results[survivor]["pid"] == names[survivor]
    sizes = _check(results, 30)
    back = sizes.index(3, 7)
    assert sizes == [3] * 7 + [2] * (back - 7) + [3] * (30 - back) and back <= 20, sizes
    assert "in-place recovery" in res.err and "a replacement starts now (restart 1 of 2)" in res.err
    assert "recovered in place from 1 failure(s):" in res.err
    assert "rank 1 (local_rank 1, host" in res.err and "signal 9 (SIGKILL)" in res.err
    assert len(zygotes(res.err)) == 1 and (tmp_path / "warm_n0.s1.1").exists(), res.err
    assert not wait_dead([*names.values(), *zygotes(res.err)], 10), "outlived the launcher"


@pytest.mark.timeout(240)
def test_a_stopped_worker_is_the_one_replaced(run: Run, tmp_path: Path) -> None:
    """A SIGSTOPped rank answers nothing: the healthy ranks time out, name it, and go on
    without it; the launcher kills it and starts its replacement (not the other way round)."""
    res = run("--standalone", "--nproc-per-node", "3", "--max-restarts", "2", TRAIN, tmp_path,
              24, "--stop", "1:12", "--wait-full", "20", "--full", "3",
              env={"TANDEM_TIMEOUT": "10"}, timeout=200)
    assert res.code == 0, res.err
    names, results = _names(tmp_path), _results(tmp_path)
    assert set(names) == {"n0.s0.0", "n0.s1.0", "n0.s2.0", "n0.s1.1"}, (names, res.err)
    assert set(results) == {"n0.s0.0", "n0.s2.0", "n0.s1.1"}, res.err
    for survivor in ("n0.s0.0", "n0.s2.0"):  # the healthy processes from start to end
        assert results[survivor]["pid"] == names[survivor]
    sizes = _check(results, 24)
    assert sizes[:12] == [3] * 12 and set(sizes) <= {2, 3} and sizes[-1] == 3, sizes
    assert "recovered in place from 1 failure(s):" in res.err, res.err
    assert "n0.s1.0" in res.err and "stopped answering" in res.err, res.err
    assert not wait_dead(list(names.values()), 10), "outlived the launcher"


@pytest.mark.timeout(180)
def test_a_spare_takes_the_lost_place_in_the_same_round(run: Run, tmp_path: Path) -> None:
    res = run("--standalone", "--nproc-per-node", "2", "--spares", "1", "--max-restarts", "1",
              TRAIN, tmp_path, 24, "--kill", "1:12", "--wait-spare", "6", timeout=150)
    assert res.code == 0, res.err
    names, results = _names(tmp_path), _results(tmp_path)
    # the spare (slot 2) replaced rank 1 at once; a new spare for slot 1 waited, then left
    assert {"n0.s0.0", "n0.s1.0", "n0.s2.0", "n0.s1.1"} == set(names), names
    assert set(results) == {"n0.s0.0", "n0.s2.0"}, results.keys()
    assert _check(results, 24) == [2] * 24
    assert "a spare starts now" in res.err
    assert "the job finished before worker n0.s1.1 was admitted" in res.err, res.err
    # the spare's lines show the rank it took, once it had taken it
    assert "[rank1]: finished as rank 1 of 2" in res.err, res.err
    assert "[spare0.0]: finished" not in res.err
    assert not wait_dead([*names.values(), *zygotes(res.err)], 10), "outlived the launcher"


@pytest.mark.timeout(180)
def test_a_slot_that_keeps_failing_backs_off_and_runs_out(run: Run, tmp_path: Path) -> None:
    # the survivor trains on once the launcher has dealt with the slot's fourth death
    res = run("--standalone", "--nproc-per-node", "2", "--max-restarts", "3", TRAIN, tmp_path,
              20, "--kill", "1:5", "--die-slot", "1", "--wait-exit", "10:n0.s1.3",
              timeout=150, env={"TANDEM_ELASTIC_BACKOFF": "0.5"})
    assert res.code == 0, res.err
    assert "a replacement starts now (restart 1 of 3)" in res.err
    assert "a replacement starts in 0.5s (death 2 of this slot) (restart 2 of 3)" in res.err
    assert "starts in 1s (death 3 of this slot) (restart 3 of 3)" in res.err, res.err
    assert "no new worker (--max-restarts 3 used up)" in res.err
    assert "recovered in place from 4 failure(s):" in res.err
    assert res.err.count("RuntimeError: worker n0.s1.") >= 3, res.err
    results = _results(tmp_path)
    assert set(results) == {"n0.s0.0"} and _check(results, 20) == [2] * 5 + [1] * 15


@pytest.mark.timeout(180)
def test_below_the_minimum_the_job_stops_naming_every_failure(run: Run, tmp_path: Path) -> None:
    res = run("--standalone", "--nproc-per-node", "3", TRAIN, tmp_path, 30, "--kill", "1:7",
              "--min-ranks", "3", timeout=150)
    assert res.code == 1, res.err
    assert "no new worker (--max-restarts 0 used up)" in res.err
    summary = res.err[res.err.index("Root cause"):]
    assert "rank       : 1 (local_rank 1" in summary and "signal 9 (SIGKILL)" in summary
    assert summary.count("ElasticError") == 2, summary
    assert "2 rank(s) remain and the job needs at least 3" in summary
    names = _names(tmp_path)
    assert not [p for p in [*names.values(), *zygotes(res.err)] if process_alive(p)]


@pytest.mark.timeout(240)
def test_two_nodes_replace_a_killed_worker_in_place(launch: Launch, tmp_path: Path) -> None:
    port = free_port()
    procs = [launch("--nnodes", "2", "--nproc-per-node", "2", "--node-rank", node,
                    "--master-addr", "127.0.0.1", "--master-port", port, "--max-restarts", 2,
                    TRAIN, tmp_path, 30, "--kill", "1:7", "--wait-full", "20", "--full", "4",
                    env=SECRET) for node in (0, 1)]
    node0, node1 = (finish(p, 200) for p in procs)
    assert node0.code == 0 and node1.code == 0, node0.err + node1.err
    names, results = _names(tmp_path), _results(tmp_path)
    assert set(names) == {"n0.s0.0", "n0.s1.0", "n1.s0.0", "n1.s1.0", "n0.s1.1"}, names
    assert set(results) == {"n0.s0.0", "n1.s0.0", "n1.s1.0", "n0.s1.1"}, results.keys()
    for survivor in ("n0.s0.0", "n1.s0.0", "n1.s1.0"):
        assert results[survivor]["pid"] == names[survivor]
    sizes = _check(results, 30)
    back = sizes.index(4, 7)
    assert sizes == [4] * 7 + [3] * (back - 7) + [4] * (30 - back) and back <= 20, sizes
    assert "a replacement starts now (restart 1 of 2)" in node0.err, node0.err
    assert "recovered in place from 1 failure(s):" in node0.err
    assert "signal 9 (SIGKILL)" in node0.err and "rank 1 (local_rank 1, host" in node0.err
    assert "in-place" not in node1.err and "Root cause" not in node1.err, node1.err
    assert (tmp_path / "warm_n0.s1.1").exists(), node0.err
    started = [*names.values(), *zygotes(node0.err), *zygotes(node1.err)]
    assert not wait_dead(started, 10), "a process outlived the launchers"
