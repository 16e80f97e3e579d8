"""Sends to a rank that left (destroy_process_group, its goodbye read) complete on every
transport: nobody will read them, as nobody reads what reached it just before it left,
and the sender's call goes on. Before, the first such send on shm failed (no ring to hand
over) and on tcp every send after the first (a broken pipe), each as "did it exit or
crash?", though the rank had left on purpose.
"""

from __future__ import annotations

import os
import threading
import time
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



STUCK_S = 2.0  # rank 0's wait for a stream that does not end, in the "stuck" case


def _send_before_goodbye_read(rank: int, world_size: int, how: str, go: str, flag: str) -> Any:
    """Rank 0's reader is held while rank 1 goes (``how``: leaves, or crashes without a
    goodbye), so a send meets the closed socket (broken pipe or reset) before rank 1's
    stream is read; "stuck": the reader stays held until that send is settled."""
    if rank == 1:
        tandem.send(torch.full((1000,), 7.0), 0)
        wait_until(lambda: os.path.exists(go), "rank 0 to hold its reader", WAIT_S)
        if how == "crash":
            Path(flag).touch()
            os._exit(0)  # no goodbye: its connections close as in a crash
        tandem.destroy_process_group()
        Path(flag).touch()
        return None
    got = torch.empty(1000)
    tandem.recv(got, 1)
    transport: Any = world().transport  # a TcpTransport: its reader and writer are wrapped
    transport._timeout = STUCK_S  # only the wait for rank 1's stream to end uses it here
    held, release, hit = threading.Event(), threading.Event(), threading.Event()
    read_frames, send_failed = transport._read_frames, transport._send_failed

    def holding_read(peer: Any) -> bool:
        if peer.rank == 1:  # rank 1's goodbye and close wait until a send has failed
            held.set()
            release.wait(WAIT_S)
        return bool(read_frames(peer))

    def noting_failure(*args: Any, **kwargs: Any) -> None:
        hit.set()
        send_failed(*args, **kwargs)

    transport._read_frames = holding_read
    transport._send_failed = noting_failure
    Path(go).touch()
    wait_until(lambda: os.path.exists(flag), "rank 1 to go", WAIT_S)
    wait_until(held.is_set, "rank 0's reader to meet rank 1's last bytes", WAIT_S)
    # the reader goes on only once a send met the closed connection, from this thread
    releaser = threading.Thread(
        target=lambda: release.set() if hit.wait(WAIT_S) and how != "stuck" else None)
    releaser.start()
    outcomes: list[str] = []
    took = 0.0  # how long the last send took
    deadline = time.monotonic() + WAIT_S
    while not hit.is_set() and time.monotonic() < deadline:
        started = time.monotonic()
        try:
            tandem.send(torch.ones(1 << 16), 1, tag=len(outcomes))
            outcomes.append("sent")
        except Exception as exc:  # noqa: BLE001 - the test names what each send raised
            outcomes.append(f"{type(exc).__name__}: {exc}")
        took = time.monotonic() - started
    release.set()
    releaser.join(WAIT_S)
    wait_until(lambda: transport.left(1) is not None or transport.lost(1) is not None,
               "rank 1's fate", WAIT_S)
    return {"hit": hit.is_set(), "failed": [o for o in outcomes if o != "sent"],
            "lost": transport.lost(1) is not None, "last_took": took}


@pytest.mark.parametrize("how", ["leave", "crash", "stuck"])
def test_a_send_that_meets_the_close_before_the_stream_is_read_waits_for_its_end(
        how: str, tmp_path: Path) -> None:
    """tcp: a send fails at the socket before the reader reached the end of rank 1's
    stream. It is settled once the stream was read to its end: completed if rank 1 said
    goodbye there (before, it failed and rank 1 was taken for a crashed rank), failed if
    not; and failed after the connect timeout if the stream does not end by then."""
    out = launch(2, _send_before_goodbye_read,
                 (how, str(tmp_path / "go"), str(tmp_path / "gone")), backend="tcp", timeout=120)
    assert out[0].ok, out[0].error
    value = out[0].value
    assert value["hit"], value
    if how == "leave":
        assert out[1].ok, out[1].error
        assert value["failed"] == [] and not value["lost"], value
        return
    assert len(value["failed"]) == 1 and value["lost"], value
    assert value["failed"][0].startswith("PeerLostError:"), value
    if how == "crash":  # failed with what the reader found: rank 1's stream just ended
        assert "rank 1 (host" in value["failed"][0], value
        assert "closed its connection to rank 0" in value["failed"][0], value
    else:  # settled by the deadline, not by the reader
        assert f"did not end within {STUCK_S:.0f}s" in value["failed"][0], value
        assert value["last_took"] >= STUCK_S * 0.9, value
