"""Failures under torch's API over "tandem" raise tandem's errors, naming ranks, in seconds.

Each rank records how its call ended (:func:`_tb_util.attempt`): the exception's
types, the rank it names and the time it took. A call that fails raises
``TandemBackendError`` (a ``torch.distributed.DistBackendError`` carrying tandem's
message); an error that reaches DDP's reducer through a future comes out of
``backward()`` as the ``RuntimeError`` torch's C++ future chain makes of any backend's
error (gloo's included), with tandem's message inside. Every job runs with a 60 s op
timeout, so an error within a few seconds comes from tandem noticing, not from a
deadline.

Run: ``python -m pytest tests/torch_backend/test_tb_faults.py -q``.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from _tb_util import attempt, init, run, values
from tandem.testing import stay_until_reported
from tandem.testing.logs import capture_logs, capture_stall_reports

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]

NOTICED_WITHIN = 5.0  # seconds; the op timeout is 60


def _tandems(r: dict[str, Any]) -> bool:
    """Whether the recorded error is tandem's, raised directly or through a torch future."""
    return "TandemBackendError" in r["types"] or "TandemBackendError: " in r["msg"]


def _model() -> DDP:
    torch.manual_seed(0)
    return DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4)))


def _step(ddp: DDP, step: int) -> None:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
    F.mse_loss(ddp(x), torch.zeros(16, 4)).backward()


def _extra_all_reduce(rank: int, world: int, store_dir: str) -> dict[str, Any]:
    init(rank, world, store_dir)
    ddp = _model()
    _step(ddp, 0)

    def training() -> None:
        for step in range(1, 4):
            if rank == 1:  # a metric logged on one rank only: the classic desync
                dist.all_reduce(torch.ones(3))  # extra-call
            _step(ddp, step)
            ddp.zero_grad()

    result = attempt(training)
    result["later"] = attempt(dist.all_reduce, torch.ones(1))
    stay_until_reported(store_dir, rank, list(range(world)))
    return result


def test_mismatched_call_under_ddp_names_both_ranks_and_the_call_site(tmp_path: Path) -> None:
    for rank, r in enumerate(values(run(2, _extra_all_reduce, tmp_path, timeout=90))):
        assert not r["ok"], f"rank {rank} trained through a mismatch"
        assert r["elapsed"] < NOTICED_WITHIN, f"rank {rank} took {r['elapsed']:.1f}s"
        assert _tandems(r), r
        assert "collective mismatch" in r["msg"], r["msg"]
        assert "rank 0" in r["msg"] and "rank 1" in r["msg"], r["msg"]
        assert "float32[3]" in r["msg"], r["msg"]  # rank 1's extra call, as signed
        assert "test_tb_faults.py" in r["msg"], r["msg"]  # the user's line, not torch's
        assert not r["later"]["ok"] and "aborted" in r["later"]["msg"], r["later"]
        assert _tandems(r["later"]), r["later"]  # an inline call's error, translated too


def _killed_mid_training(rank: int, world: int, store_dir: str, stamp: str) -> dict[str, Any]:
    init(rank, world, store_dir)
    ddp = _model()
    _step(ddp, 0)
    dist.barrier()
    if rank == 2:
        def die() -> None:
            Path(stamp).write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(0.3, die).start()

    def training() -> None:
        for step in range(100_000):
            _step(ddp, step)

    result = attempt(training)
    stay_until_reported(store_dir, rank, [0, 1])  # rank 2 was killed
    return result


def test_sigkilled_rank_under_ddp_is_named_within_seconds(tmp_path: Path) -> None:
    stamp = tmp_path / "stamp"
    outcomes = run(3, _killed_mid_training, tmp_path, str(stamp), timeout=90)
    killed_at = float(stamp.read_text())
    for rank, r in enumerate(values(outcomes[:2])):
        assert not r["ok"], f"rank {rank} trained on after rank 2 died"
        assert r["at"] - killed_at < NOTICED_WITHIN, f"rank {rank}: {r['at'] - killed_at:.1f}s"
        assert _tandems(r), r
        assert "PeerLostError" in r["msg"] and "rank 2 (pid" in r["msg"], r["msg"]


def _timeouts(rank: int, world: int, store_dir: str) -> dict[str, Any]:
    init(rank, world, store_dir)
    pair = dist.new_group([0, 1])
    for group in (None, pair):  # the first call of a group sets up its shared memory
        dist.barrier(group=group)
    out: dict[str, Any] = {}
    if rank == 0:
        out["monitored"] = attempt(dist.monitored_barrier,
                                   timeout=datetime.timedelta(seconds=1), wait_all_ranks=True)
        opts = dist.AllreduceOptions()
        opts.timeout = datetime.timedelta(seconds=1)
        out["call_timeout"] = attempt(lambda: pair.allreduce([torch.ones(2)], opts).wait())
        out["later"] = attempt(dist.all_reduce, torch.ones(1), group=pair)
    time.sleep(4.0)  # rank 1 arrives late everywhere
    if rank == 1:
        out["late"] = attempt(dist.all_reduce, torch.ones(1))
        out["late_pair"] = attempt(dist.all_reduce, torch.ones(1), group=pair)
    return out


def test_call_timeouts_abort_the_group_and_name_the_missing_rank(tmp_path: Path) -> None:
    first, second = values(run(2, _timeouts, tmp_path, timeout=90))
    monitored = first["monitored"]
    assert not monitored["ok"] and monitored["missing"] == (1,), monitored
    assert "TandemBackendError" in monitored["types"], monitored
    assert "rank(s) [1] did not arrive" in monitored["msg"], monitored
    assert monitored["elapsed"] < 1.0 + NOTICED_WITHIN, monitored
    call = first["call_timeout"]
    assert not call["ok"] and "DistBackendError" in call["types"], call
    assert call["cause"] == "CollectiveTimeoutError", call
    assert "within its timeout of 1s" in call["msg"] and call["elapsed"] < 1.0 + NOTICED_WITHIN
    assert not first["later"]["ok"] and "aborted" in first["later"]["msg"], first["later"]
    assert _tandems(first["later"]), first["later"]
    for late in (second["late"], second["late_pair"]):  # each group was aborted everywhere
        assert not late["ok"] and "aborted" in late["msg"], late


STALL_WARN = 1.0  # TANDEM_STALL_WARN of the stall test


def _stopped_rank(rank: int, world: int, store_dir: str) -> dict[str, Any]:
    reports = capture_stall_reports()
    init(rank, world, store_dir, timeout=10)
    dist.all_reduce(torch.ones(4))  # everyone is connected
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # never resumed: the harness kills it
    start = time.monotonic()
    result = attempt(dist.all_reduce, torch.ones(4))  # stalled-call
    result["reports"] = reports.since(start)
    return result


def test_a_stopped_rank_is_reported_by_the_watchdog_under_the_torch_backend(
        tmp_path: Path) -> None:
    from _tb_util import env
    from tandem.testing import launch

    outcomes = launch(3, _stopped_rank, (str(tmp_path),), timeout=100, init=False,
                      env={**env(), "TANDEM_STALL_WARN": str(STALL_WARN)})
    assert outcomes[2].error_type == "stopped", outcomes[2]
    for rank, r in enumerate(values(outcomes[:2])):
        assert r["reports"], f"rank {rank} waited {r['elapsed']:.0f}s without a stall report"
        took, first = r["reports"][0]
        assert took < STALL_WARN + 10, f"rank {rank}: first report after {took:.1f}s:\n{first}"
        assert re.match(rf"tandem: rank {rank} has waited \d+ s in all_reduce", first), first
        assert "rank 2" in first and "has not arrived" in first, first
        assert not r["ok"] and "rank(s) 2" in r["msg"], r  # then the deadline names it


def _unreceived_send(rank: int, world: int, store_dir: str) -> list[str]:
    logged = capture_logs("no receive took")
    init(rank, world, store_dir)
    if rank == 0:
        dist.isend(torch.ones(6), 1, tag=3).wait()  # 24 bytes rank 1 never receives
        dist.send(torch.ones(1), 1, tag=4)
    else:
        dist.recv(torch.empty(1), 0, tag=4)  # sent later on the same link: tag 3 has arrived
    dist.barrier()
    dist.destroy_process_group()
    return logged.messages()


def test_a_send_nobody_received_is_named_when_torch_destroys_the_group(tmp_path: Path) -> None:
    on_sender, on_receiver = values(run(2, _unreceived_send, tmp_path, timeout=90))
    assert on_sender == [], on_sender
    assert len(on_receiver) == 1 and "from rank 0 with tag 3: 1 message(s) of 24 bytes" \
        in on_receiver[0], on_receiver
