"""A rank SIGKILLed mid-collective is named by the survivors within seconds, over shm.

Three ranks loop over 4 MiB all_reduces; rank 2 kills itself. The kernel closes its
end of every UNIX socket at once; the survivors' watcher threads see EOF, their
readers drain what rank 2 wrote before dying, and report it lost. Runs on memfd
rings (the default) and on named /dev/shm segments (the fallback path).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from _shm_fault_ranks import forks_then_dies, kill_during_all_reduce, oversized
from tandem._proc import process_alive
from tandem.testing import launch, spawn

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]

NOTICED_WITHIN = 3.0  # seconds from the kill to the error; the op timeout is 60 s


def tandem_shm_names() -> set[str]:
    """tandem's /dev/shm files, but those of a process that still runs: another job's
    segment lives there for a moment before its unlink (tests run several files at once)."""
    return {n for n in os.listdir("/dev/shm") if "tandem" in n and not _owner_runs(n)}


def _owner_runs(name: str) -> bool:
    pid = name.removeprefix("tandem-shm-").partition("-")[0]
    return pid.isdigit() and process_alive(int(pid))


@pytest.fixture(scope="module", params=["shm", "shm-devshm"])
def killed(request: Any, tmp_path_factory: Any) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp(request.param)
    before = tandem_shm_names()
    outcomes = launch(3, kill_during_all_reduce,
                      (request.param, str(tmp / "store"), str(tmp / "stamp")),
                      init=False, timeout=90)
    bad = [o for o in outcomes[:2] if not o.ok]
    assert not bad, "\n".join(f"--- rank {o.rank} ---\n{o.error}" for o in bad)
    return {"kind": request.param, "survivors": {o.rank: o.value for o in outcomes[:2]},
            "killed_at": float(Path(tmp / "stamp").read_text()), "victim": outcomes[2],
            "new_names": tandem_shm_names() - before}


def test_survivors_raise_peer_lost_naming_the_killed_rank(killed: Any) -> None:
    for rank, r in killed["survivors"].items():
        f = r["failure"]
        assert not f["ok"] and f["type"] == "PeerLostError", (killed["kind"], rank, f)
        assert f["rank"] == 2 and "rank 2" in f["msg"], (killed["kind"], rank, f["msg"])


def test_the_death_is_noticed_within_seconds_not_at_the_op_timeout(killed: Any) -> None:
    for rank, r in killed["survivors"].items():
        latency = r["failure"]["at"] - killed["killed_at"]
        assert latency < NOTICED_WITHIN, f"{killed['kind']} rank {rank}: {latency:.2f}s"


def test_the_group_fails_fast_after_the_loss(killed: Any) -> None:
    for rank, r in killed["survivors"].items():
        later = r["later"]
        assert not later["ok"] and later["elapsed"] < NOTICED_WITHIN, (rank, later)
        assert "rank 2" in later["msg"], (rank, later["msg"])


def test_the_victim_really_died_of_sigkill(killed: Any) -> None:
    assert killed["victim"].exitcode == -9, killed["victim"]


def test_a_kill_leaves_nothing_in_dev_shm(killed: Any) -> None:
    assert not killed["new_names"], f"{killed['kind']}: left behind {killed['new_names']}"


def test_survivors_map_only_nameless_segments(killed: Any) -> None:
    for rank, r in killed["survivors"].items():
        assert r["maps"], f"rank {rank} maps no rings at all?"
        assert all(m.endswith("(deleted)") for m in r["maps"]), (rank, r["maps"])


def test_a_forked_child_does_not_hide_its_parents_death(tmp_path: Any) -> None:
    outcomes = launch(2, forks_then_dies, (str(tmp_path / "store"), str(tmp_path / "stamp")),
                      init=False, timeout=60)
    r = outcomes[0].value
    assert outcomes[0].ok and not r["ok"] and r["type"] == "PeerLostError", outcomes[0]
    latency = r["at"] - float((tmp_path / "stamp").read_text())
    assert latency < NOTICED_WITHIN, f"noticed after {latency:.2f}s (the child held the socket?)"


def test_an_oversized_frame_is_refused_and_the_sender_learns_at_once(tmp_path: Any) -> None:
    r0, r1 = spawn(2, oversized, (str(tmp_path / "store"),), init=False, timeout=60,
                   env={"TANDEM_MAX_FRAME": "4096"})
    refused = r1["big"]
    assert not refused["ok"] and "16384" in refused["msg"] and "4096" in refused["msg"], refused
    after = r0["after"]  # the receiver closed the connection: no waiting for a deadline
    assert not after["ok"] and after["type"] in ("PeerLostError", "StateError"), after
    assert after["elapsed"] < NOTICED_WITHIN, after
