"""Every main collective and p2p pattern gives the same bits over shm, tcp, auto and mixed.

One spawn per (backend, ranks) runs the whole battery of ``_shm_ranks``: all_reduce
with each algorithm (1, 1000 and 3M+5 floats: larger than any ring), MAX, broadcast,
all_gather, reduce_scatter, all_to_all, send/recv and isend/irecv around a ring.
Each rank returns digests; expected digests come from the inputs alone.
"""

from __future__ import annotations

from typing import Any

import pytest

from _shm_ranks import battery, expected_for
from tandem.testing import launch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(240)]

RUNS = {
    "shm-2": ("shm", 2, None),
    "shm-4": ("shm", 4, None),
    "tcp-4": ("tcp", 4, None),
    "auto-2": ("auto", 2, None),
    "auto-2-hosts-4": ("auto", 4, ["a", "a", "b", "b"]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: Any) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for name, (backend, p, hosts) in RUNS.items():
        store = str(tmp_path_factory.mktemp(name) / "store")
        outcomes = launch(p, battery, (backend, store, hosts), init=False, timeout=200)
        bad = [o for o in outcomes if not o.ok]
        assert not bad, f"{name}:\n" + "\n".join(f"--- rank {o.rank} ---\n{o.error}" for o in bad)
        out[name] = [o.value for o in outcomes]
    return out


def _differences(run: list[dict[str, Any]]) -> list[str]:
    p = len(run)
    wrong = []
    for rank, got in enumerate(run):
        for key, want in expected_for(rank, p, got["shares_memory"]).items():
            if got.get(key) != want:
                wrong.append(f"rank {rank} {key}")
    return wrong


@pytest.mark.parametrize("name", ["shm-2", "shm-4"])
def test_every_collective_over_shm_gives_the_exact_result(results: Any, name: str) -> None:
    wrong = _differences(results[name])
    assert not wrong, f"{name}: wrong results for {wrong}"


def test_shm_and_tcp_agree_bit_for_bit(results: Any) -> None:
    for rank, (shm, tcp) in enumerate(zip(results["shm-4"], results["tcp-4"])):
        differ = [k for k in tcp if k not in ("transport", "backend", "shares_memory", "tcp_links")
                  and shm[k] != tcp[k]]
        assert not differ, f"rank {rank}: shm and tcp differ on {differ}"


def test_shm_backend_runs_on_the_shm_transport(results: Any) -> None:
    for r in results["shm-2"]:
        assert (r["backend"], r["transport"]) == ("shm", "ShmTransport"), r


def test_same_host_groups_share_staging_memory_and_others_do_not(results: Any) -> None:
    # with it, all_reduce reads peers' staging directly (algorithm "shm"), checked above
    for name, shares in [("shm-2", True), ("shm-4", True), ("auto-2", True),
                         ("tcp-4", False), ("auto-2-hosts-4", False)]:
        assert {r["shares_memory"] for r in results[name]} == {shares}, name


def test_auto_on_one_host_uses_shared_memory(results: Any) -> None:
    assert not _differences(results["auto-2"])
    assert {r["transport"] for r in results["auto-2"]} == {"ShmTransport"}


def test_auto_across_hosts_mixes_shm_within_and_tcp_across(results: Any) -> None:
    wrong = _differences(results["auto-2-hosts-4"])
    assert not wrong, f"mixed topology: wrong results for {wrong}"
    assert {r["transport"] for r in results["auto-2-hosts-4"]} == {"MixedTransport"}


def test_mixed_transport_links_same_host_peers_by_shared_memory_only(results: Any) -> None:
    # one link per peer: a goodbye sent after a message can never overtake it on another
    for rank, r in enumerate(results["auto-2-hosts-4"]):
        other_host = [2, 3] if rank < 2 else [0, 1]
        assert r["tcp_links"] == other_host, (rank, r["tcp_links"])
