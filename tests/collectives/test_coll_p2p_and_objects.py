"""Point-to-point, monitored_barrier and the object collectives, on threads.

In a thread group global ranks equal group ranks. The same functions run over TCP
against gloo in ``test_coll_vs_gloo``; subgroups are covered there and in
``test_coll_groups``.
"""

from __future__ import annotations

import threading

import pytest
import torch

import tandem
from tandem.errors import CollectiveMismatchError, CollectiveTimeoutError, StateError
from tandem.testing import run_threads

from _coll_util import assert_equal

pytestmark = pytest.mark.timeout(60)


# -- point-to-point ----------------------------------------------------------------------
def test_recv_matches_messages_by_tag_not_by_arrival() -> None:
    def body(group):
        if group.rank() == 0:
            tandem.send(torch.full((3,), 1.0), dst=1, group=group, tag=1)
            tandem.send(torch.full((3,), 2.0), dst=1, group=group, tag=2)
            return None
        two, one = torch.empty(3), torch.empty(3)
        tandem.recv(two, src=0, group=group, tag=2)
        tandem.recv(one, src=0, group=group, tag=1)
        return one, two

    one, two = run_threads(2, body)[1]
    assert_equal(one, torch.full((3,), 1.0), "rank 1: recv(tag=1)")
    assert_equal(two, torch.full((3,), 2.0), "rank 1: recv(tag=2)")


def test_messages_with_the_same_tag_arrive_in_send_order() -> None:
    def body(group):
        if group.rank() == 0:
            works = [tandem.isend(torch.full((5,), float(i)), dst=1, group=group, tag=4)
                     for i in range(10)]
            for w in works:
                w.wait()
            return None
        outs = [torch.empty(5) for _ in range(10)]
        for w in [tandem.irecv(t, src=0, group=group, tag=4) for t in outs]:
            w.wait()
        return outs

    for i, t in enumerate(run_threads(2, body)[1]):
        assert_equal(t, torch.full((5,), float(i)), f"rank 1: message #{i} with tag 4")


def test_recv_from_any_source_returns_each_senders_rank() -> None:
    def body(group):
        if group.rank() != 0:
            tandem.send(torch.full((2,), float(group.rank())), dst=0, group=group, tag=9)
            return None
        got = []
        for _ in range(group.size() - 1):
            t = torch.empty(2)
            sender = tandem.recv(t, group=group, tag=9)
            got.append((sender, t))
        return got

    got = run_threads(4, body)[0]
    assert sorted(s for s, _ in got) == [1, 2, 3], f"rank 0: recv(src=None) senders {got}"
    for sender, t in got:
        assert_equal(t, torch.full((2,), float(sender)), f"rank 0: payload from rank {sender}")


def test_irecv_from_any_source_reports_source_rank() -> None:
    def body(group):
        if group.rank() == 2:
            tandem.send(torch.ones(1), dst=0, group=group)
        if group.rank() == 0:
            work = tandem.irecv(torch.empty(1), group=group)
            work.wait()
            return work.source_rank()
        return None

    assert run_threads(3, body)[0] == 2, "rank 0: irecv(src=None).source_rank()"


def test_isend_irecv_works_complete_and_carry_the_data() -> None:
    def body(group):
        peer = 1 - group.rank()
        out = torch.empty(100000)
        recv = tandem.irecv(out, src=peer, group=group)
        send = tandem.isend(torch.full((100000,), float(group.rank())), dst=peer, group=group)
        send.wait()
        recv.wait()
        return send.is_completed(), recv.is_completed(), out

    for rank, (sent, received, out) in enumerate(run_threads(2, body)):
        assert sent and received, f"rank {rank}: isend/irecv Work not completed after wait"
        assert_equal(out, torch.full((100000,), float(1 - rank)), f"rank {rank}: irecv data")


def test_batch_isend_irecv_exchanges_around_a_ring() -> None:
    def body(group):
        p, r = group.size(), group.rank()
        left, right = torch.empty(3), torch.empty(3)
        ops = [tandem.P2POp(tandem.isend, torch.full((3,), float(r)), (r + 1) % p, group),
               tandem.P2POp(tandem.isend, torch.full((3,), float(-r)), (r - 1) % p, group),
               tandem.P2POp(tandem.irecv, left, (r - 1) % p, group),
               tandem.P2POp(tandem.irecv, right, (r + 1) % p, group)]
        works = tandem.batch_isend_irecv(ops)
        for w in works:
            w.wait()
        return len(works), left, right

    p = 4
    for r, (n, left, right) in enumerate(run_threads(p, body)):
        assert n == 4, f"rank {r}: batch_isend_irecv returned {n} works for 4 ops"
        assert_equal(left, torch.full((3,), float((r - 1) % p)), f"rank {r}: from the left")
        assert_equal(right, torch.full((3,), -float((r + 1) % p)), f"rank {r}: from the right")


def test_p2p_and_collectives_on_one_group_do_not_interfere() -> None:
    def body(group):
        r = group.rank()
        if r == 0:
            work = tandem.isend(torch.full((4,), 7.0), dst=1, group=group)
        t = torch.full((4,), float(r))
        tandem.all_reduce(t, group=group)
        got = None
        if r == 1:
            got = torch.empty(4)
            tandem.recv(got, src=0, group=group)
        else:
            work.wait()
        return t, got

    results = run_threads(2, body)
    for r, (t, _) in enumerate(results):
        assert_equal(t, torch.full((4,), 1.0), f"rank {r}: all_reduce between isend and recv")
    assert_equal(results[1][1], torch.full((4,), 7.0), "rank 1: recv after all_reduce")


def test_irecv_wait_that_timed_out_can_be_waited_on_again_and_gets_the_message() -> None:
    sent = threading.Event()

    def body(group):
        if group.rank() == 0:
            sent.wait()
            tandem.send(torch.full((2,), 5.0), dst=1, group=group)
            tandem.send(torch.full((2,), 6.0), dst=1, group=group)
            return None
        first, second = torch.zeros(2), torch.zeros(2)
        work = tandem.irecv(first, src=0, group=group)
        with pytest.raises(CollectiveTimeoutError):
            work.wait(timeout=0.1)
        sent.set()
        work.wait(timeout=5)
        tandem.recv(second, src=0, group=group)
        return first, second

    first, second = run_threads(2, body, op_timeout=5.0)[1]
    assert_equal(first, torch.full((2,), 5.0), "rank 1: irecv waited on again after a timeout")
    assert_equal(second, torch.full((2,), 6.0), "rank 1: the next recv gets the next message")


def test_recv_into_a_tensor_of_the_wrong_size_names_both_sizes() -> None:
    def body(group):
        if group.rank() == 0:
            tandem.send(torch.ones(2), dst=1, group=group)
            return None
        with pytest.raises(CollectiveMismatchError, match="sent 8 bytes but rank 1 expected 12"):
            tandem.recv(torch.zeros(3), src=0, group=group)

    run_threads(2, body, op_timeout=5.0)


@pytest.mark.parametrize("src", [0, None], ids=["from_rank_0", "from_any_rank"])
def test_recv_into_a_tensor_of_another_dtype_names_both_dtypes(src) -> None:
    # 4 float32 are as many bytes as 4 int32: without the check the receiver would get
    # the floats' bit patterns as integers
    def body(group):
        if group.rank() == 0:
            tandem.send(torch.ones(4), dst=1, group=group)
            return None
        with pytest.raises(CollectiveMismatchError, match="rank 0 sent float32.*rank 1 "
                                                          "receives into int32"):
            tandem.recv(torch.zeros(4, dtype=torch.int32), src=src, group=group)

    run_threads(2, body, op_timeout=5.0)


# -- monitored_barrier -------------------------------------------------------------------
def test_monitored_barrier_returns_when_every_rank_arrives() -> None:
    def body(group):
        return tandem.monitored_barrier(group=group, timeout=5.0)

    assert run_threads(3, body) == [None, None, None]


def test_monitored_barrier_names_the_rank_that_did_not_arrive() -> None:
    def body(group):
        if group.rank() == 2:
            return None  # never arrives
        with pytest.raises(CollectiveTimeoutError) as info:
            tandem.monitored_barrier(group=group, timeout=0.5)
        return info.value

    error = run_threads(3, body)[0]
    assert error.missing == (2,) and "[2]" in str(error), f"rank 0: {error}"


def test_monitored_barrier_wait_all_ranks_names_every_missing_rank() -> None:
    def body(group):
        if group.rank() >= 2:
            return None
        with pytest.raises(CollectiveTimeoutError) as info:
            tandem.monitored_barrier(group=group, timeout=0.5, wait_all_ranks=True)
        return info.value

    error = run_threads(4, body)[0]
    assert error.missing == (2, 3) and "[2, 3]" in str(error), f"rank 0: {error}"


# -- object collectives ------------------------------------------------------------------
OBJECTS = [{"a": 1, "nested": [1, 2, {"b": None}]}, "text", 3.25, (1, "two"), None,
           torch.arange(3), b"\x00\xff" * 1000]


def test_broadcast_object_list_replaces_every_entry_on_receivers() -> None:
    def body(group):
        objs = list(OBJECTS) if group.rank() == 1 else [None] * len(OBJECTS)
        tandem.broadcast_object_list(objs, src=1, group=group)
        return objs

    for rank, objs in enumerate(run_threads(3, body)):
        assert len(objs) == len(OBJECTS)
        for i, (got, want) in enumerate(zip(objs, OBJECTS)):
            same = torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
            assert same, f"rank {rank}: broadcast_object_list entry {i} is {got!r}, expected {want!r}"


def test_broadcast_object_list_of_another_length_names_the_lists() -> None:
    def body(group):
        objs = list(OBJECTS) if group.rank() != 0 else [None]  # rank 0's list is too short
        try:
            tandem.broadcast_object_list(objs, src=1, group=group)
        except (CollectiveMismatchError, StateError) as exc:
            return exc  # the others learn of it from rank 0
        return objs

    out = run_threads(3, body)
    assert isinstance(out[0], CollectiveMismatchError), out[0]
    assert "broadcast_object_list: object_list has 1 entries on rank 0" in str(out[0]), out[0]
    assert "as long as the source's" in str(out[0]), out[0]


def test_all_gather_object_collects_objects_of_different_sizes() -> None:
    def body(group):
        out = [None] * group.size()
        tandem.all_gather_object(out, {"rank": group.rank(), "pad": "x" * 1000 * group.rank()},
                                 group=group)
        return out

    expected = [{"rank": r, "pad": "x" * 1000 * r} for r in range(3)]
    for rank, out in enumerate(run_threads(3, body)):
        assert out == expected, f"rank {rank}: all_gather_object gave {[o['rank'] for o in out]}"


def test_gather_object_fills_the_list_on_dst_only() -> None:
    def body(group):
        out = [None] * group.size() if group.rank() == 2 else None
        tandem.gather_object(["r", group.rank()] * (group.rank() + 1), out, dst=2, group=group)
        return out

    results = run_threads(3, body)
    assert results[2] == [["r", r] * (r + 1) for r in range(3)], f"rank 2: {results[2]}"
    assert results[0] is None and results[1] is None


def test_scatter_object_list_gives_each_rank_its_object() -> None:
    def body(group):
        out = [None]
        ins = [{"to": i, "blob": "y" * 500 * i} for i in range(group.size())] \
            if group.rank() == 0 else None
        tandem.scatter_object_list(out, ins, src=0, group=group)
        return out[0]

    for rank, obj in enumerate(run_threads(3, body)):
        assert obj == {"to": rank, "blob": "y" * 500 * rank}, f"rank {rank}: got {obj!r}"


def test_send_and_recv_object_list_round_trip() -> None:
    def body(group):
        if group.rank() == 1:
            tandem.send_object_list([{"k": [1, 2]}, "v", 7], dst=0, group=group)
            return None
        out = [None, None, None]
        sender = tandem.recv_object_list(out, group=group)  # from any source
        return sender, out

    sender, out = run_threads(2, body)[0]
    assert sender == 1, f"rank 0: recv_object_list returned sender {sender}"
    assert out == [{"k": [1, 2]}, "v", 7], f"rank 0: recv_object_list gave {out}"
