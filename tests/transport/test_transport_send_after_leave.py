"""Sends to a rank that left (destroy_process_group, its goodbye read) complete on every
transport: nobody will read them, as nobody reads what reached it just before it left,
and the sender's call goes on. Before, the first such send on shm failed (no ring to hand
over) and on tcp every send after the first (a broken pipe), each as "did it exit or
crash?", though the rank had left on purpose.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem
from tandem.collectives.world import world
from tandem.testing import launch, wait_until

pytestmark = [pytest.mark.procs, pytest.mark.timeout(180)]

WAIT_S = 60.0
SENDS = 4  # a tcp connection takes the first frame after the peer's close; later ones fail


def _send_after_leave(rank: int, world_size: int, flag: str) -> Any:
    if rank == 1:
        tandem.send(torch.full((1000,), 7.0), 0)
        tandem.destroy_process_group()
        Path(flag).touch()
        return None
    wait_until(lambda: os.path.exists(flag), "rank 1 to leave", WAIT_S)
    got = torch.empty(1000)
    tandem.recv(got, 1)  # sent before it left: delivered
    transport = world().transport
    wait_until(lambda: transport.left(1) is not None, "rank 1's goodbye", WAIT_S)
    outcomes = []
    for i in range(SENDS):
        try:
            tandem.send(torch.ones(1 << 16), 1, tag=i)
            outcomes.append("sent")
        except Exception as exc:  # noqa: BLE001 - the test names what each send raised
            outcomes.append(f"{type(exc).__name__}: {exc}")
    return {"received": float(got[0]), "sends": outcomes, "lost": repr(transport.lost(1))}


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_sends_to_a_rank_that_left_complete(backend: str, tmp_path: Path) -> None:
    out = launch(2, _send_after_leave, (str(tmp_path / "left"),), backend=backend, timeout=120)
    bad = [o for o in out if not o.ok]
    assert not bad, "\n".join(f"--- rank {o.rank} ---\n{o.error}" for o in bad)
    assert out[0].value == {"received": 7.0, "sends": ["sent"] * SENDS, "lost": "None"}, \
        out[0].value
