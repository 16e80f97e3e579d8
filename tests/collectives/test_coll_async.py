"""``async_op=True``: the Work handle (wait, is_completed, exception, get_future) and ordering.

Threads over the loopback transport; a rank that must observe an operation still in
flight holds its peer back with a ``threading.Event`` until it has looked.
"""

from __future__ import annotations

import threading

import pytest
import torch

import tandem
from tandem.errors import CollectiveMismatchError, CollectiveTimeoutError
from tandem.testing import run_threads

from _coll_util import assert_equal

pytestmark = pytest.mark.timeout(60)


def test_work_is_not_completed_until_every_rank_joined_then_wait_returns_true() -> None:
    joined = threading.Event()

    def body(group):
        t = torch.full((6,), float(group.rank() + 1))
        if group.rank() == 0:
            work = tandem.all_reduce(t, group=group, async_op=True)
            pending = work.is_completed()
            joined.set()
            done = work.wait()
            return pending, done, work.is_completed(), t
        joined.wait()
        tandem.all_reduce(t, group=group)
        return None

    pending, done, completed, t = run_threads(2, body)[0]
    assert pending is False, "rank 0: is_completed() was True before rank 1 joined"
    assert done is True, f"rank 0: wait() returned {done!r}, torch returns True"
    assert completed is True, "rank 0: is_completed() is False after wait()"
    assert_equal(t, torch.full((6,), 3.0), "rank 0: async all_reduce result")


def test_get_future_value_is_the_list_of_result_tensors() -> None:
    def body(group):
        t = torch.full((3,), float(group.rank()))
        fut = tandem.all_reduce(t, group=group, async_op=True).get_future()
        value = fut.wait()
        return isinstance(fut, torch.futures.Future), value, t

    for rank, (is_future, value, t) in enumerate(run_threads(3, body)):
        assert is_future, f"rank {rank}: get_future() is not a torch.futures.Future"
        assert isinstance(value, list) and len(value) == 1 and value[0] is t, (
            f"rank {rank}: future value is {value!r}, expected [the all_reduce tensor]")
        assert_equal(t, torch.full((3,), 3.0), f"rank {rank}: async all_reduce result")


def test_get_future_after_completion_is_already_done() -> None:
    def body(group):
        work = tandem.broadcast(torch.arange(4.0) * group.rank(), src=1, group=group,
                                async_op=True)
        work.wait()
        fut = work.get_future()
        return fut.done(), fut.value()[0]

    for rank, (done, value) in enumerate(run_threads(2, body)):
        assert done, f"rank {rank}: future of a completed broadcast is not done"
        assert_equal(value, torch.arange(4.0), f"rank {rank}: future value of broadcast")


def test_exception_is_none_after_success() -> None:
    def body(group):
        work = tandem.all_reduce(torch.ones(2), group=group, async_op=True)
        work.wait()
        return work.exception(), work.is_success()

    for rank, (error, success) in enumerate(run_threads(2, body)):
        assert error is None and success, f"rank {rank}: exception()={error!r} after success"


def test_failed_async_op_reports_its_error_through_wait_exception_and_future() -> None:
    def body(group):
        t = torch.ones(4) if group.rank() == 0 else torch.ones(5)  # shapes differ: mismatch
        work = tandem.all_reduce(t, group=group, async_op=True)
        with pytest.raises(CollectiveMismatchError):
            work.wait()
        with pytest.raises(CollectiveMismatchError):
            work.get_future().wait()
        return work.is_completed(), work.exception()

    for rank, (completed, error) in enumerate(run_threads(2, body, op_timeout=5.0)):
        assert completed, f"rank {rank}: a failed Work is not completed"
        assert isinstance(error, CollectiveMismatchError), f"rank {rank}: exception()={error!r}"
        assert "float32[4]" in str(error) and "float32[5]" in str(error), f"rank {rank}: {error}"


def test_wait_with_timeout_raises_but_the_operation_still_completes() -> None:
    late = threading.Event()

    def body(group):
        t = torch.full((2,), float(group.rank() + 1))
        if group.rank() == 0:
            work = tandem.all_reduce(t, group=group, async_op=True)
            with pytest.raises(CollectiveTimeoutError):
                work.wait(timeout=0.1)
            late.set()
            work.wait()
            return t
        late.wait()
        tandem.all_reduce(t, group=group)
        return t

    for rank, t in enumerate(run_threads(2, body)):
        assert_equal(t, torch.full((2,), 3.0), f"rank {rank}: all_reduce after a timed-out wait")


def test_async_ops_on_one_group_complete_in_issue_order() -> None:
    def body(group):
        order: list[int] = []
        lock = threading.Lock()
        tensors, chained = [], []
        for i in range(12):
            t = torch.full((1000 * (12 - i),), float(i + group.rank()))  # later ops smaller
            work = tandem.all_reduce(t, group=group, async_op=True)

            def done(_fut, i=i):
                with lock:
                    order.append(i)

            # the chained future completes after its callback ran
            chained.append(work.get_future().then(done))
            tensors.append(t)
        torch.futures.wait_all(chained)
        return order, tensors

    for rank, (order, tensors) in enumerate(run_threads(3, body)):
        assert order == list(range(12)), f"rank {rank}: async ops completed in order {order}"
        for i, t in enumerate(tensors):
            assert_equal(t, torch.full_like(t, 3.0 * i + 3), f"rank {rank}: async all_reduce #{i}")


def test_blocking_call_after_async_ones_waits_for_them() -> None:
    def body(group):
        works = [tandem.all_reduce(torch.ones(50000), group=group, async_op=True)
                 for _ in range(4)]
        t = torch.ones(1)
        tandem.all_reduce(t, group=group)
        return [w.is_completed() for w in works], t

    for rank, (completed, t) in enumerate(run_threads(2, body)):
        assert all(completed), f"rank {rank}: a blocking all_reduce returned before earlier " \
                               f"async ops completed ({completed})"
        assert_equal(t, torch.full((1,), 2.0), f"rank {rank}: blocking all_reduce")


@pytest.mark.parametrize("name", ["broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                                  "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor",
                                  "all_to_all", "all_to_all_single", "barrier"])
def test_every_collective_accepts_async_op(name: str) -> None:
    def body(group):
        p, r = group.size(), group.rank()
        x = torch.full((2,), float(r + 1))
        calls = {
            "broadcast": lambda: tandem.broadcast(x, src=0, group=group, async_op=True),
            "reduce": lambda: tandem.reduce(x, dst=0, group=group, async_op=True),
            "all_gather": lambda: tandem.all_gather([torch.empty(2) for _ in range(p)], x,
                                                    group=group, async_op=True),
            "all_gather_into_tensor": lambda: tandem.all_gather_into_tensor(
                torch.empty(2 * p), x, group=group, async_op=True),
            "gather": lambda: tandem.gather(x, [torch.empty(2) for _ in range(p)] if r == 0
                                            else None, dst=0, group=group, async_op=True),
            "scatter": lambda: tandem.scatter(x, [torch.ones(2)] * p if r == 0 else None,
                                              src=0, group=group, async_op=True),
            "reduce_scatter": lambda: tandem.reduce_scatter(x, [torch.ones(2)] * p,
                                                            group=group, async_op=True),
            "reduce_scatter_tensor": lambda: tandem.reduce_scatter_tensor(
                x, torch.ones(2 * p), group=group, async_op=True),
            "all_to_all": lambda: tandem.all_to_all([torch.empty(2) for _ in range(p)],
                                                    [x] * p, group=group, async_op=True),
            "all_to_all_single": lambda: tandem.all_to_all_single(
                torch.empty(2 * p), torch.ones(2 * p), group=group, async_op=True),
            "barrier": lambda: tandem.barrier(group=group, async_op=True),
        }
        work = calls[name]()
        return isinstance(work, tandem.Work), work.wait()

    for rank, (is_work, waited) in enumerate(run_threads(2, body)):
        assert is_work and waited is True, f"rank {rank}: {name}(async_op=True) gave no Work"


def test_future_callback_may_issue_a_blocking_collective() -> None:
    # callbacks run off the progress engine, so a blocking call inside one can complete
    def body(group):
        first = tandem.all_reduce(torch.ones(4), group=group, async_op=True)

        def then(_fut):
            x = torch.full((2,), float(group.rank() + 1))
            tandem.all_reduce(x, group=group)
            return x

        return first.get_future().then(then).wait()

    for rank, got in enumerate(run_threads(2, body, op_timeout=5.0)):
        assert_equal(got, torch.full((2,), 3.0), f"rank {rank}: all_reduce inside a callback")
