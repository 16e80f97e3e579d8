"""Every transport passes the same conformance checks (``_conformance.py``).

Kinds: ``loopback`` (threads), ``tcp``, ``shm`` (1 MiB rings), ``shm-devshm`` (named
segments in /dev/shm, the fallback when memfd is unavailable) and ``mixed`` (3 ranks,
two simulated hosts: shm between ranks 0 and 1, tcp to rank 2). One run per kind
executes every check; each test reads one behaviour from every rank's records.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from _conformance import check_peer_closed, run_all
from _transport_ranks import WORLD, conformance
from tandem.testing import launch
from tandem.transport.loopback import LoopbackHub

pytestmark = [pytest.mark.procs, pytest.mark.timeout(180)]

KINDS = ["loopback", "tcp", "shm", "shm-devshm", "mixed"]


def _loopback() -> list[dict[str, Any]]:
    hub = LoopbackHub(2)
    barrier = threading.Barrier(2)
    records: list[dict[str, Any]] = [{}, {}]

    def sync() -> None:
        barrier.wait(60)

    def body(rank: int) -> None:
        t = hub.transports[rank]
        records[rank] = run_all(t, [(0, 1)], sync)
        records[rank]["closed"] = check_peer_closed(t, rank, 1 - rank, closer=(rank == 1))

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    return records


@pytest.fixture(scope="module", params=KINDS)
def run(request: Any, tmp_path_factory: Any) -> tuple[str, list[dict[str, Any]]]:
    kind = request.param
    if kind == "loopback":
        return kind, _loopback()
    tmp = str(tmp_path_factory.mktemp(kind))
    outcomes = launch(WORLD[kind], conformance, (kind, tmp), init=False, timeout=150)
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(f"--- rank {o.rank} ({o.error_type}) ---\n{o.error}" for o in bad)
    return kind, [o.value for o in outcomes]


def _records(run: tuple[str, list[dict[str, Any]]], check: str) -> list[tuple[str, Any]]:
    kind, per_rank = run
    found = [(f"{kind} rank {r} {key}", rec) for r, recs in enumerate(per_rank)
             for key, rec in recs.items() if key.startswith(check + "/")]
    assert found, f"{kind}: no {check} records"
    for where, rec in found:
        assert "exception" not in rec, f"{where}: {rec['exception']}"
    return found


def test_every_size_arrives_intact_in_both_directions(run: Any) -> None:
    for where, rec in _records(run, "sizes"):
        assert all(rec["ok"].values()), f"{where}: sizes {rec['ok']} (True = intact)"


def test_messages_between_two_ranks_arrive_in_send_order(run: Any) -> None:
    for where, rec in _records(run, "order"):
        assert rec["order"] == list(range(200)), f"{where}: {rec['order'][:20]}..."


def test_early_arrivals_are_parked_until_their_receive_is_posted(run: Any) -> None:
    for where, rec in _records(run, "parked"):
        assert rec["ok"] == [True, True], where


def test_concurrent_senders_and_shuffled_receives_all_match(run: Any) -> None:
    for where, rec in _records(run, "concurrent"):
        assert not rec["errors"] and not rec["bad"], f"{where}: {rec}"


def test_a_rank_can_message_itself(run: Any) -> None:
    for where, rec in _records(run, "self"):
        assert rec["ok"], where


def test_a_mismatch_fails_only_that_receive_and_the_stream_stays_intact(run: Any) -> None:
    for where, rec in _records(run, "mismatch"):
        assert rec["signature"] == "CollectiveMismatchError", f"{where}: {rec}"
        assert rec["size"] == "CollectiveMismatchError", f"{where}: {rec}"
        assert "broadcast" in rec["message"] and "all_reduce" in rec["message"], where
        assert rec["next"], f"{where}: the message after the mismatches was corrupted"


def test_an_abort_fails_the_peers_pending_receives_with_the_same_error(run: Any) -> None:
    for where, rec in _records(run, "abort"):
        assert rec["error"] == "CollectiveMismatchError", f"{where}: {rec}"
        assert "told everyone to stop" in rec["message"], f"{where}: {rec}"


def test_a_closed_peer_is_reported_lost_by_rank(run: Any) -> None:
    kind, per_rank = run
    rec = per_rank[0]["closed"]
    assert rec["error"] == "PeerLostError" and rec["rank"] == 1, f"{kind}: {rec}"
    assert "rank 1" in rec["message"], f"{kind}: {rec['message']}"
    assert rec["elapsed"] < 5.0, f"{kind}: noticed after {rec['elapsed']:.1f}s"
