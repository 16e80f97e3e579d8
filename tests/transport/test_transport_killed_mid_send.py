"""A sender SIGKILLed in the middle of a large message: the receive fails, naming it.

The message arrives before its receive is posted, so it is being parked when the
sender dies; the receive posted as the sender dies must raise ``PeerLostError``
naming the sender within seconds (the op timeout is a minute), on every backend.
``cut`` writes only part of the payload before the kill, so the death always
falls inside the message; ``send`` is a real 256 MB send killed 0.15 s in (on a
fast host the send may finish first: then the data must be whole).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem as dist
from _cut import cut_message
from tandem.collectives.world import world
from tandem.testing import launch, wait_until
from tandem.transport import Header, Kind

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]

NBYTES = 256 << 20
NOTICED_WITHIN = 5.0


def _attempt_recv(buf: torch.Tensor) -> dict[str, Any]:
    start = time.monotonic()
    try:
        dist.recv(buf, src=1)
    except Exception as exc:  # noqa: BLE001 - described for the test
        return {"ok": False, "type": type(exc).__name__, "msg": str(exc),
                "rank": getattr(exc, "rank", None), "at": time.time(),
                "elapsed": time.monotonic() - start}
    return {"ok": True, "whole": bool((buf == 1).all()), "at": time.time()}


def _die(stamp: str) -> None:
    """SIGKILL this process, noting the wall time of the kill in ``stamp`` first."""
    with open(stamp, "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _killed_mid_send(rank: int, world_size: int, how: str, stamp: str) -> Any:
    # filling 256 MB (seconds under load) before the barrier: no part of the time to notice
    buf = torch.zeros(NBYTES // 4) if rank == 0 else torch.empty(0)
    dist.barrier()
    if rank == 1:
        if how == "cut":
            header = Header(Kind.P2P, 0, 0, 0, NBYTES)
            cut_message(world().transport, 0, header, bytes(NBYTES // 4))
            time.sleep(0.15)
        else:
            data = torch.ones(NBYTES // 4)
            threading.Timer(0.15, _die, (stamp,)).start()
            dist.send(data, dst=0)
            time.sleep(5)
        _die(stamp)
    # the receive is posted once the sender is about to die (it notes the kill first)
    wait_until(lambda: os.path.exists(stamp), "rank 1 to note its kill", 60)
    result = _attempt_recv(buf)
    if not result["ok"]:  # the sender's own note of its kill: on a loaded machine writing
        # the cut message can take seconds, so a time guessed here from the barrier could
        # come long before the kill
        with open(stamp) as f:
            result["killed_at"] = float(f.read())
    return result


@pytest.mark.parametrize("backend", [pytest.param("tcp", marks=pytest.mark.smoke("tandem.transport")),
                                     "shm", "auto"])
@pytest.mark.parametrize("how", ["cut", "send"])
def test_receive_of_a_message_cut_by_the_senders_death_fails_naming_it(
        tmp_path: Path, backend: str, how: str) -> None:
    outcomes = launch(2, _killed_mid_send, (how, str(tmp_path / "killed_at")), backend=backend,
                      timeout=60, op_timeout=60.0)
    r0 = outcomes[0]
    assert r0.ok, r0.error
    r = r0.value
    if r["ok"]:
        assert how == "send" and r["whole"], r  # the send beat the kill: data intact
        return
    assert r["type"] == "PeerLostError" and r["rank"] == 1, r
    assert "rank 1" in r["msg"], r
    assert r["at"] - r["killed_at"] < NOTICED_WITHIN, r
