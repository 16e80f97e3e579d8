"""When the rank that hosts the store (rank 0) is stopped, the live ranks still name it,
and only it: in their stall reports (the store cannot carry their answers) and in
their timeouts."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem as dist
from _fault_helpers import attempt, values, warm_up
from tandem.testing import launch
from tandem.testing.logs import capture_stall_reports

pytestmark = [pytest.mark.timeout(180), pytest.mark.procs]

WORLD = 4
STALL = 1.5  # TANDEM_STALL_WARN: the first report comes well before the timeout
OP_TIMEOUT = 20.0  # reports come at 1.5, 3, 6 and 12 s


def _store_host_stopped(rank: int, world_size: int, where: str, backend: str) -> Any:
    torch.set_num_threads(1)
    port_file = Path(where) / "port"
    if rank == 0:  # the store lives in rank 0's process, as with env:// and tcp://
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                              wait_for_workers=False, timeout=OP_TIMEOUT)
        (Path(where) / "port.tmp").write_text(str(store.port))
        os.replace(Path(where) / "port.tmp", port_file)
    else:
        deadline = time.monotonic() + 60
        while not port_file.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        store = dist.TCPStore("127.0.0.1", int(port_file.read_text()), world_size,
                              is_master=False, timeout=OP_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=OP_TIMEOUT)
    reports = capture_stall_reports()
    dist.all_reduce(torch.ones(4))  # everyone is connected
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
    result = attempt(dist.all_reduce, torch.ones(1 << 12))
    result["reports"] = reports.messages()
    return result


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_only_the_stopped_store_host_is_named(backend: str, tmp_path: Path) -> None:
    warm_up()
    outcomes = launch(WORLD, _store_host_stopped, (str(tmp_path), backend), init=False,
                      timeout=120, env={"TANDEM_STALL_WARN": str(STALL),
                                        "TANDEM_TIMEOUT": str(OP_TIMEOUT)})
    for rank, r in values(outcomes, [1, 2, 3]).items():
        assert not r["ok"] and r["type"] == "CollectiveTimeoutError", (rank, r)
        assert r["missing"] == (0,), (rank, r["missing"], r["msg"])
        timeout_text = r["msg"].split(" timed out", 1)[1]
        assert "rank(s) 0" in timeout_text and not any(
            f"rank(s) {live}" in timeout_text for live in (1, 2, 3)), (rank, r["msg"])
        reports = r["reports"]
        assert reports, f"rank {rank} made no stall report"
        for text in reports:  # a live rank may be late, never "not answering"
            blamed = [line for line in text.splitlines() if "no answer" in line]
            assert blamed and all(line.startswith("  rank 0 has not arrived: no answer")
                                  for line in blamed), (rank, text)
        assert any("  arrived: ranks 1-3 (3 of 4)" in text for text in reports), (rank, reports)
