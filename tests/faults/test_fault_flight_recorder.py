"""Flight-recorder dumps of real failures, and what ``python -m tandem.trace`` makes of them:
a rank that skipped a call is *behind*, ranks that called different collectives are named
with both calls, a killed rank *died*; ``SIGUSR1`` dumps a rank on demand."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem as dist
from _fault_helpers import attempt, line_of, values, warm_up
from tandem.testing import launch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]

OP_TIMEOUT = 2.0
# a tick of the watchdog: a rank that learns of a failure elsewhere dumps within it
ENV = {"TANDEM_STALL_WARN": "1"}


def _trace(directory: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "tandem.trace", str(directory)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _run(fn: Any, world_size: int, directory: Path, backend: str = "tcp") -> list[Any]:
    warm_up()
    return launch(world_size, fn, backend=backend, timeout=60, op_timeout=OP_TIMEOUT,
                  env={**ENV, "TANDEM_TRACE_DIR": str(directory)})


def _skips_a_call(rank: int, world_size: int) -> Any:
    dist.all_reduce(torch.ones(4))  # first-call
    if rank == 2:
        # alive, but never calls the second all_reduce; it stays until the others' timeout
        # has reached it and its watchdog dumped (bounded: the test fails without a dump)
        mine = os.path.join(os.environ["TANDEM_TRACE_DIR"], "rank2.json")
        deadline = time.monotonic() + 30.0
        while not os.path.exists(mine) and time.monotonic() < deadline:
            time.sleep(0.05)  # skipper
        return "skipped"
    return attempt(dist.all_reduce, torch.ones(4))  # second


def test_a_rank_that_skipped_a_call_is_behind(tmp_path: Path) -> None:
    values(_run(_skips_a_call, 3, tmp_path), [0, 1, 2])
    assert sorted(os.listdir(tmp_path)) == ["rank0.json", "rank1.json", "rank2.json"]
    text = _trace(tmp_path)
    first, skipper = line_of(__file__, "first-call"), line_of(__file__, "skipper")
    assert "group 'default' (ranks 0-2), call #1: rank 2 is behind" in text, text
    # the call site of the second all_reduce is the fault helpers' ``attempt``
    assert ("ranks 0-1 are in all_reduce float32[4] op=SUM algorithm=doubling at "
            "_fault_helpers.py:") in text, text
    assert "failed: CollectiveTimeoutError" in text, text
    assert (f"rank 2: last call #0 all_reduce at test_fault_flight_recorder.py:{first} "
            f"(completed); not in a collective; main thread at "
            f"test_fault_flight_recorder.py:{skipper} in _skips_a_call") in text, text


def _mismatch(rank: int, world_size: int) -> Any:
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        return attempt(dist.broadcast, torch.ones(4), 0)
    return attempt(dist.all_reduce, torch.ones(4))


@pytest.mark.parametrize("backend", ["tcp", "auto"])
def test_ranks_that_called_different_collectives_are_named(tmp_path: Path, backend: str) -> None:
    results = values(_run(_mismatch, 2, tmp_path, backend), [0, 1])
    assert all(r["type"] == "CollectiveMismatchError" for r in results.values()), results
    text = _trace(tmp_path)
    algorithm = "doubling" if backend == "tcp" else "shm"
    assert "group 'default' (ranks 0-1), call #1: ranks called different collectives" in text
    assert f"  rank 0: all_reduce float32[4] op=SUM algorithm={algorithm} at _fault_helpers.py:" \
        in text, text
    assert "  rank 1: broadcast float32[4] root=0 at _fault_helpers.py:" in text, text


def _killed(rank: int, world_size: int) -> Any:
    dist.all_reduce(torch.ones(4))
    if rank == 2:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    return attempt(dist.all_reduce, torch.ones(4))


def test_a_killed_rank_died(tmp_path: Path) -> None:
    outcomes = _run(_killed, 3, tmp_path)
    results = values(outcomes, [0, 1])
    assert all(r["type"] == "PeerLostError" for r in results.values()), results
    assert outcomes[2].exitcode == -signal.SIGKILL
    text = _trace(tmp_path)
    # a survivor that hears of the loss from the other one first (its call aborted) may
    # dump before its own connection to rank 2 has closed: then only the other lost it
    assert re.search(r"rank 2 died: no dump; (ranks 0-1|rank 0|rank 1) lost it: rank 2 ",
                     text), text
    assert "the ranks' recorded calls agree on every group" in text, text


def _signalled(rank: int, world_size: int) -> Any:
    directory = os.environ["TANDEM_TRACE_DIR"]
    ready = os.path.join(os.path.dirname(directory), "rank0-waits")
    dist.all_reduce(torch.ones(4))
    pids = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    deadline = time.monotonic() + 20
    if rank == 0:
        Path(ready).touch()
        while not os.path.exists(os.path.join(directory, "rank0.json")):  # waiting-loop
            assert time.monotonic() < deadline, "no dump within 20 s of SIGUSR1"
            time.sleep(0.01)  # signalled-here
        return None
    while not os.path.exists(ready):  # signal rank 0 once it is in its loop
        assert time.monotonic() < deadline, "rank 0 did not reach its loop"
        time.sleep(0.01)
    os.kill(pids[0], signal.SIGUSR1)
    return None


def test_sigusr1_dumps_the_rank_with_where_its_main_thread_is(tmp_path: Path) -> None:
    dumps = tmp_path / "trace"
    values(_run(_signalled, 2, dumps, "tcp"), [0, 1])
    data = json.loads((dumps / "rank0.json").read_text())
    assert data["reason"] == "SIGUSR1" and data["rank"] == 0 and data["world_size"] == 2
    # the signal lands somewhere in rank 0's waiting loop
    lines = range(line_of(__file__, "waiting-loop"), line_of(__file__, "signalled-here") + 1)
    assert data["main_thread"] in [f"test_fault_flight_recorder.py:{n} in _signalled"
                                   for n in lines], data["main_thread"]
    (group,) = data["groups"]
    ops = [(c["seq"], c["op"], c["state"]) for c in group["calls"]]
    assert ops[0] == (0, "all_reduce", "completed"), ops
    assert ops[-1][1:] == ("all_gather", "completed"), ops  # all_gather_object's last call
    assert group["name"] == "default" and group["issued"] == len(ops), group


def _dump_to_a_file(rank: int, world_size: int) -> Any:
    import logging

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tandem").addHandler(handler)
    outcome = attempt(dist.dump_flight_recorder)
    outcome["warnings"] = warnings
    return outcome


def test_a_trace_dir_that_cannot_be_written_is_named_in_the_warning(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    results = values(_run(_dump_to_a_file, 2, tmp_path / "a-file" / "trace"), [0, 1])
    for rank, r in results.items():
        assert not r["ok"] and r["type"] == "StateError", (rank, r)
        assert any(f"rank {rank} could not write its flight recorder to "
                   f"{tmp_path}/a-file/trace (TANDEM_TRACE_DIR)" in w for w in r["warnings"]), r
