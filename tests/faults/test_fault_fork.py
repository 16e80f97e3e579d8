"""A rank that forked a child (a DataLoader worker, say) and then died is still noticed at
once: the child must not keep the dead rank's connections open."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem
from tandem.errors import PeerLostError
from tandem.testing import launch

pytestmark = pytest.mark.procs


def _rank(rank: int, world_size: int, pid_file: str) -> dict[str, Any]:
    tandem.all_reduce(torch.ones(4))  # the mesh is up
    if rank == 1:
        child = os.fork()
        if child == 0:  # the forked worker outlives its parent for a while
            time.sleep(20)
            os._exit(0)
        Path(pid_file).write_text(str(child))
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        tandem.all_reduce(torch.ones(4))
    except PeerLostError as exc:
        return {"type": "PeerLostError", "rank": exc.rank, "took": time.monotonic() - start}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"type": type(exc).__name__, "took": time.monotonic() - start}
    return {"type": "no error"}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_death_of_a_rank_with_a_forked_child_is_noticed(tmp_path: Path, backend: str) -> None:
    pid_file = tmp_path / "child"
    try:
        outcomes = launch(2, _rank, (str(pid_file),), backend=backend, op_timeout=30, timeout=60)
    finally:
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    survivor = outcomes[0]
    assert survivor.ok, survivor.error
    assert survivor.value["type"] == "PeerLostError", survivor.value
    assert survivor.value["rank"] == 1 and survivor.value["took"] < 5, survivor.value
