"""Membership in the store (``tandem.elastic.roster``), on a HashStore: who is in the next
generation, when a round closes, spares, and the end of the job."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.elastic.roster import Generation, Roster
from tandem.errors import ElasticError, TimeoutError
from tandem.store.hash import HashStore
from tandem.testing import wait_until


def _roster(*workers: str, node: str = "n0") -> Roster:
    roster = Roster(HashStore(), "job")
    for w in workers:
        roster.register(w, node, "host", 1)
    return roster


def _close(roster: Roster, gen: Generation, seconds: float = 2.0, max_ranks: int = 0,
           min_ranks: int = 1, min_nodes: int = 1) -> Generation:
    return roster.close_round(gen, time.monotonic() + seconds, max_ranks=max_ranks,
                              min_ranks=min_ranks, min_nodes=min_nodes)


def test_generation_zero_turns_the_job_elastic_and_the_first_proposal_wins() -> None:
    roster = _roster("a", "b")
    assert not roster.is_on() and roster.latest() == -1
    assert roster.propose(Generation(0, ("a", "b"))).members == ("a", "b")
    assert roster.propose(Generation(0, ("b", "a"))).members == ("a", "b")
    assert roster.is_on() and roster.latest() == 0


def test_a_round_waits_for_every_member_that_is_not_known_gone() -> None:
    roster = _roster("a", "b", "c")
    gen = roster.propose(Generation(0, ("a", "b", "c")))
    roster.arrive(0, "a")
    roster.report_lost(0, ["b"])
    with pytest.raises(TimeoutError, match="c neither arrived nor were known gone"):
        _close(roster, gen, seconds=0.2)
    roster.arrive(0, "c")
    assert _close(roster, gen) == Generation(1, ("a", "c"), 0)


def test_an_exit_reported_by_an_agent_counts_as_gone() -> None:
    roster = _roster("a", "b")
    gen = roster.propose(Generation(0, ("a", "b")))
    roster.arrive(0, "b")
    closing = threading.Timer(0.1, roster.report_exit, ("a",))
    closing.start()
    assert _close(roster, gen).members == ("b",)
    closing.join()


def test_joiners_fill_the_room_in_queue_order_and_the_rest_wait_as_spares() -> None:
    roster = _roster("a", "b", "j1", "j2", "j3")
    gen = roster.propose(Generation(0, ("a", "b")))
    for j in ("j1", "j2", "j3"):
        roster.enqueue_joiner(j)
    roster.report_exit("j1")
    assert roster.joiners_waiting(gen, max_ranks=3)
    assert not roster.joiners_waiting(Generation(0, ("a", "b", "c")), max_ranks=3)
    roster.arrive(0, "a")
    roster.arrive(0, "b")
    nxt = _close(roster, gen, max_ranks=3)
    assert nxt.members == ("a", "b", "j2") and nxt.upto == 2  # j3 waits, j1 is gone
    assert not roster.joiners_waiting(nxt, max_ranks=3)
    assert roster.joiners_waiting(nxt, max_ranks=4)


def test_below_the_minimum_the_round_waits_for_coming_joiners_then_ends_the_job() -> None:
    roster = _roster("a", "b", "c")
    gen = roster.propose(Generation(0, ("a", "b", "c")))
    roster.arrive(0, "a")
    roster.report_lost(0, ["b", "c"])
    roster.expect(+1)  # an agent started a replacement
    late = threading.Timer(0.2, lambda: (roster.register("r", "n0", "host", 2),
                                         roster.enqueue_joiner("r"), roster.expect(-1)))
    late.start()
    assert _close(roster, gen, min_ranks=2).members == ("a", "r")
    late.join()
    roster.arrive(1, "a")
    roster.report_lost(1, ["r"])
    ended = _close(roster, Generation(1, ("a", "r"), 1), min_ranks=2)
    assert ended.members == () and "1 rank(s) remain and the job needs at least 2" in ended.ended
    roster.end(ended.ended)
    with pytest.raises(ElasticError, match="lost: r"):
        roster.raise_if_ended()


def _c_of_node_1_lost(managed: bool = False) -> tuple[Roster, Generation]:
    """a and b on node n0 arrived at round 0; c, alone on n1, did not."""
    roster = _roster("a", "b", node="n0")
    roster.register("c", "n1", "host", 3)
    if managed:
        roster.manage()
    gen = roster.propose(Generation(0, ("a", "b", "c")))
    roster.arrive(0, "a")
    roster.arrive(0, "b")
    return roster, gen


def test_the_minimum_number_of_nodes() -> None:
    roster, gen = _c_of_node_1_lost()
    roster.report_exit("c")
    ended = _close(roster, gen, min_nodes=2)
    assert "on 1 node(s) remain and the job needs at least 2 nodes" in ended.ended


def test_a_short_round_of_an_agents_job_hears_the_agent_before_it_ends_the_job() -> None:
    # the members saw c's connection close before c's agent looked at its workers: the
    # round waits for the agent's exit report, which follows its announced replacement
    roster, gen = _c_of_node_1_lost(managed=True)
    roster.report_lost(0, ["c"])
    looks = [0]  # the round's looks at the store

    def agent() -> None:
        wait_until(lambda: looks[0] >= 5, "the round to look without the agent's report",
                   30)
        roster.expect(+1)  # the replacement, planned first
        roster.report_exit("c")
        seen = looks[0]
        wait_until(lambda: looks[0] >= seen + 5, "the round to look after c's exit", 30)
        roster.register("r", "n1", "host", 4)
        roster.enqueue_joiner("r")
        roster.expect(-1)

    def watch() -> None:
        looks[0] += 1

    late = threading.Thread(target=agent)
    late.start()
    gen1 = roster.close_round(gen, time.monotonic() + 2.0, max_ranks=0, min_ranks=1,
                              min_nodes=2, watch=watch)
    late.join(30)
    assert gen1.members == ("a", "b", "r")


def test_a_short_round_without_an_agent_ends_the_job_at_once() -> None:
    roster, gen = _c_of_node_1_lost()
    roster.report_lost(0, ["c"])
    started = time.monotonic()
    assert "needs at least 2 nodes" in _close(roster, gen, seconds=30, min_nodes=2).ended
    assert time.monotonic() - started < 5


def test_with_little_room_joiners_of_the_emptiest_node_go_first() -> None:
    roster, gen = _c_of_node_1_lost()
    roster.report_exit("c")
    roster.register("s0", "n0", "host", 4)  # node 0's spare queued first
    roster.register("s1", "n1", "host", 5)
    roster.enqueue_joiner("s0")
    roster.enqueue_joiner("s1")
    nxt = _close(roster, gen, max_ranks=3, min_nodes=2)
    assert nxt.members == ("a", "b", "s1") and nxt.upto == 0  # s0 still waits
    assert roster.joiners_waiting(nxt, max_ranks=4)
    roster.arrive(1, "a")
    roster.arrive(1, "b")
    roster.arrive(1, "s1")
    assert _close(roster, nxt, max_ranks=4).members == ("a", "b", "s1", "s0")
