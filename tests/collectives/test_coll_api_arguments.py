"""Arguments of the public functions are validated before anything is allocated or sent.

Two settings: ``solo`` is a one-rank job in this process (for functions that need an
initialised job), ``g`` is rank 1 of a 3-rank loopback group whose other ranks never run,
so a check that were missing would start communicating and end in a timeout instead of
the ``ArgumentError`` expected here.
"""

from __future__ import annotations

import datetime
import math
import resource
import time

import pytest
import torch

import tandem
from tandem.collectives.group import ProcessGroup
from tandem.config import Settings
from tandem.errors import ArgumentError, TandemError
from tandem.transport.loopback import LoopbackHub

from _coll_util import LONELY_SIZE

pytestmark = pytest.mark.timeout(60)

P = LONELY_SIZE
NON_FINITE = [math.nan, math.inf, -1.0, datetime.timedelta(seconds=-3)]


@pytest.fixture
def g(lonely: ProcessGroup) -> ProcessGroup:
    return lonely


def f(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


# -- timeouts (NaN, infinite and negative deadlines are no deadlines) -------------------------
@pytest.mark.parametrize("value", NON_FINITE, ids=str)
def test_barrier_refuses_a_timeout_that_is_no_deadline(g: ProcessGroup, value: object) -> None:
    with pytest.raises(ArgumentError, match="barrier: timeout"):
        tandem.barrier(group=g, timeout=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["no", 0, None], ids=repr)
def test_monitored_barrier_refuses_a_wait_all_ranks_that_is_not_a_bool(g: ProcessGroup,
                                                                       value: object) -> None:
    with pytest.raises(ArgumentError, match="monitored_barrier: wait_all_ranks must be a bool"):
        tandem.monitored_barrier(group=g, wait_all_ranks=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", NON_FINITE, ids=str)
def test_monitored_barrier_refuses_a_timeout_that_is_no_deadline(g: ProcessGroup,
                                                                 value: object) -> None:
    with pytest.raises(ArgumentError, match="monitored_barrier: timeout"):
        tandem.monitored_barrier(group=g, timeout=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", NON_FINITE, ids=str)
def test_new_group_refuses_a_timeout_that_is_no_deadline(solo: None, value: object) -> None:
    with pytest.raises(ArgumentError, match="new_group: timeout"):
        tandem.new_group([0], timeout=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", NON_FINITE, ids=str)
def test_init_process_group_refuses_a_timeout_that_is_no_deadline(job_secret: bytes,
                                                                  value: object) -> None:
    with pytest.raises(ArgumentError, match="init_process_group: timeout"):
        tandem.init_process_group("tcp", store=tandem.HashStore(), rank=0, world_size=1,
                                  timeout=value)  # type: ignore[arg-type]
    assert not tandem.is_initialized()


def test_init_process_group_refuses_a_nan_connect_timeout_setting(
        job_secret: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CONNECT_TIMEOUT", "nan")
    with pytest.raises(ArgumentError, match="TANDEM_CONNECT_TIMEOUT"):
        tandem.init_process_group("tcp", store=tandem.HashStore(), rank=0, world_size=1)
    assert not tandem.is_initialized()


@pytest.mark.parametrize("value", NON_FINITE, ids=str)
def test_work_wait_refuses_a_timeout_that_is_no_deadline(g: ProcessGroup, value: object) -> None:
    work = tandem.irecv(f(2), 0, group=g)
    with pytest.raises(ArgumentError, match="Work.wait: timeout"):
        work.wait(timeout=value)  # type: ignore[arg-type]
    assert not work.is_completed()


@pytest.mark.parametrize("value", [math.nan, math.inf, -2.0], ids=str)
def test_store_timeouts_are_checked_the_same_way(value: float) -> None:
    with pytest.raises(ArgumentError, match="timeout"):
        tandem.HashStore(timeout=value)
    store = tandem.HashStore()
    with pytest.raises(ArgumentError, match="timeout"):
        store.wait(["k"], timeout=value)
    with pytest.raises(ArgumentError, match="timeout"):
        store.set_timeout(value)


# -- sizes and ranks ---------------------------------------------------------------------------
@pytest.mark.parametrize("rank,world_size,match", [
    (0, 0, "world_size must be"),
    (0, -5, "world_size must be"),
    (0, 2.0, "world_size must be an int"),
    ("0", 1, "rank must be an int"),
    (True, 2, "rank must be an int"),
    (3, 2, r"rank must be in \[0, 2\)"),
], ids=["zero", "negative", "float", "str-rank", "bool-rank", "rank-outside"])
def test_init_process_group_refuses_bad_ranks_and_sizes(job_secret: bytes, rank: object,
                                                       world_size: object, match: str) -> None:
    with pytest.raises(ArgumentError, match=match):
        tandem.init_process_group("tcp", store=tandem.HashStore(), rank=rank,  # type: ignore[arg-type]
                                  world_size=world_size)  # type: ignore[arg-type]
    assert not tandem.is_initialized()


def test_init_process_group_refuses_a_torch_store_naming_tandems(job_secret: bytes) -> None:
    import torch.distributed as td

    with pytest.raises(ArgumentError, match=r"init_process_group takes a tandem store.*"
                                            r"torch\.distributed.s HashStore.*tandem\.HashStore"):
        tandem.init_process_group("tcp", store=td.HashStore(), rank=0, world_size=1)
    assert not tandem.is_initialized()


def _huge_world(rank: int, world_size: int) -> tuple[str, float, str]:
    """In a rank process with its address space capped: without a check, a world of 2**40
    ranks allocates per-rank bookkeeping until the machine runs out of memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, hard))
    start = time.monotonic()
    try:
        tandem.init_process_group("tcp", store=tandem.HashStore(), rank=0, world_size=2**40)
        return "returned", time.monotonic() - start, ""
    except BaseException as exc:  # noqa: BLE001 - described for the test
        return type(exc).__name__, time.monotonic() - start, str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))  # the harness's reply may allocate


@pytest.mark.procs
def test_a_world_of_2_to_the_40_ranks_is_refused_before_allocating() -> None:
    from tandem.testing import spawn

    # forked with torch imported: a fresh interpreter took over 50 s to import and exit
    # at load 50
    [(kind, seconds, message)] = spawn(1, _huge_world, init=False, timeout=50)
    assert kind == "ArgumentError", (kind, message)
    assert "world_size" in message and "1099511627776" in message, message
    assert seconds < 5, f"refusing took {seconds:.1f}s"


@pytest.mark.parametrize("url,match", [
    ("file:///tmp/x?rank=abc&world_size=1", "rank='abc'"),
    ("file:///tmp/x?rank=0&world_size=two", "world_size='two'"),
    ("tcp://127.0.0.1:1?rank=0&world_size=1e3", "world_size='1e3'"),
])
def test_init_method_query_values_that_are_not_integers_are_named(job_secret: bytes, url: str,
                                                                  match: str) -> None:
    with pytest.raises(ArgumentError, match=match):
        tandem.init_process_group("tcp", init_method=url)


@pytest.mark.parametrize("url,env,match", [
    ("env://", {"WORLD_SIZE": "0", "RANK": "0"}, r"WORLD_SIZE='0' is out of range.*1\.\."),
    ("file:///tmp/x?rank=0&world_size=0", {}, r"world_size='0' is out of range.*1\.\."),
    ("env://", {"WORLD_SIZE": "2", "RANK": "5"}, r"RANK='5' is out of range.* = 1"),
], ids=["env-zero-world", "file-zero-world", "env-rank-outside"])
def test_a_world_size_of_zero_is_named_not_reported_missing(
        job_secret: bytes, monkeypatch: pytest.MonkeyPatch, url: str, env: dict[str, str],
        match: str) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # never reached: the check comes first
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ArgumentError, match=match):
        tandem.init_process_group("tcp", init_method=url)
    assert not tandem.is_initialized()


@pytest.mark.parametrize("ranks,match", [
    ([0, "1"], "ranks must be ints"),
    ([0.0], "ranks must be ints"),
    ([True], "ranks must be ints"),
    ([2 ** 40], "outside the world"),
    ([-1], "outside the world"),
], ids=["str", "float", "bool", "huge", "negative"])
def test_new_group_ranks_are_checked(solo: None, ranks: list[object], match: str) -> None:
    with pytest.raises(ArgumentError, match=match):
        tandem.new_group(ranks)  # type: ignore[arg-type]


@pytest.mark.parametrize("ranks,named", [
    (list(range(2 ** 20 + 5)), "ranks [1-1048580] are outside the world [0, 1)"),
    (list(range(1, 2 ** 21, 2)), "ranks [1, 3, 5, 7, 9, 11, 13, 15, ... (1048576 ranks)] are "
                                 "outside"),
    ([0] + list(range(1, 2 ** 20)) * 2, "ranks [1-1048575] are given more than once"),
], ids=["a million outside", "a million scattered outside", "a million twice"])
def test_a_refused_rank_list_is_named_in_one_short_line(solo: None, ranks: list[int],
                                                        named: str) -> None:
    with pytest.raises(ArgumentError) as info:
        tandem.new_group(ranks)
    assert named in str(info.value) and len(str(info.value)) < 200, str(info.value)[:300]


def test_new_group_takes_integer_ranks_of_any_integer_type(solo: None) -> None:
    import numpy

    g = tandem.new_group(numpy.arange(1))  # type: ignore[arg-type]
    assert tandem.get_process_group_ranks(g) == [0]
    assert type(tandem.get_process_group_ranks(g)[0]) is int


# -- point-to-point tags -----------------------------------------------------------------------
@pytest.mark.parametrize("tag", [2 ** 40, 2 ** 31, -(2 ** 31) - 1], ids=str)
@pytest.mark.parametrize("call", ["isend", "irecv"])
def test_p2p_tag_outside_32_bits_is_refused_on_both_sides(g: ProcessGroup, call: str,
                                                          tag: int) -> None:
    with pytest.raises(ArgumentError, match=f"{call}: tag={tag}"):
        getattr(tandem, call)(f(2), 0, group=g, tag=tag)


@pytest.mark.parametrize("tag", ["1", 1.0, None], ids=repr)
def test_p2p_tag_that_is_not_an_int_is_refused(g: ProcessGroup, tag: object) -> None:
    with pytest.raises(ArgumentError, match="tag must be an int"):
        tandem.isend(f(2), 0, group=g, tag=tag)  # type: ignore[arg-type]


# -- tensors whose elements share memory --------------------------------------------------------
def _expanded(n: int = 4) -> torch.Tensor:
    return torch.zeros(1).expand(n)  # stride 0: every element is the same memory


OVERLAPPING_OUTPUTS = {
    "all_reduce": lambda g: tandem.all_reduce(_expanded(), group=g),
    "broadcast": lambda g: tandem.broadcast(_expanded(), src=0, group=g),
    "reduce": lambda g: tandem.reduce(_expanded(), dst=0, group=g),
    "all_reduce_coalesced": lambda g: tandem.all_reduce_coalesced([f(4), _expanded()], group=g),
    "all_gather": lambda g: tandem.all_gather([f(4), f(4), _expanded()], f(4), group=g),
    "all_gather_into_tensor": lambda g: tandem.all_gather_into_tensor(_expanded(12), f(4),
                                                                      group=g),
    "gather": lambda g: tandem.gather(f(4), [f(4), _expanded(), f(4)], dst=1, group=g),
    "scatter": lambda g: tandem.scatter(_expanded(), None, src=0, group=g),
    "reduce_scatter": lambda g: tandem.reduce_scatter(_expanded(), [f(4)] * P, group=g),
    "reduce_scatter_tensor": lambda g: tandem.reduce_scatter_tensor(_expanded(), f(12), group=g),
    "all_to_all": lambda g: tandem.all_to_all([f(2), f(2), _expanded(2)], [f(2)] * P, group=g),
    "all_to_all_single": lambda g: tandem.all_to_all_single(_expanded(3), f(3), group=g),
    "recv": lambda g: tandem.irecv(_expanded(), src=0, group=g),
}


@pytest.mark.parametrize("call", list(OVERLAPPING_OUTPUTS))
def test_output_whose_elements_overlap_in_memory_is_refused(g: ProcessGroup, call: str) -> None:
    with pytest.raises(ArgumentError, match="overlap"):
        OVERLAPPING_OUTPUTS[call](g)


@pytest.fixture
def one() -> ProcessGroup:
    """A group of one rank: calls complete at once."""
    hub = LoopbackHub(1)
    return ProcessGroup(hub.transports[0], [0], 0, "one", 1.0, Settings(), "loopback")


def test_overlapping_input_is_fine_only_outputs_are_refused(one: ProcessGroup) -> None:
    # reading the same element several times is harmless
    out = [f(4)]
    tandem.all_gather(out, torch.ones(1).expand(4), group=one)
    assert out[0].tolist() == [1.0] * 4


def test_an_interleaved_view_that_does_not_overlap_is_accepted(one: ProcessGroup) -> None:
    base = torch.arange(8.0)
    view = base.as_strided((3, 2), (2, 3))  # offsets 0 2 4 / 3 5 7: distinct, not dense
    tandem.all_reduce(view, group=one)
    assert base.tolist() == list(map(float, range(8)))


def test_an_as_strided_view_that_overlaps_is_refused(g: ProcessGroup) -> None:
    view = torch.arange(8.0).as_strided((2, 2), (1, 1))  # offsets 0 1 / 1 2
    with pytest.raises(ArgumentError, match="overlap"):
        tandem.all_reduce(view, group=g)


# -- all_to_all_single splits -----------------------------------------------------------------
def test_all_to_all_single_rows_of_different_sizes_are_named(g: ProcessGroup) -> None:
    with pytest.raises(ArgumentError, match=r"rows of 3 elements.*rows of 2"):
        tandem.all_to_all_single(f(3, 3), f(3, 2), group=g)


@pytest.mark.parametrize("splits", [[1.0, 1.0, 1.0], ["1", 1, 1], [True, 1, 1]], ids=str)
def test_all_to_all_single_splits_must_be_ints(g: ProcessGroup, splits: list[object]) -> None:
    with pytest.raises(ArgumentError, match="input_split_sizes"):
        tandem.all_to_all_single(f(3), f(3), [1, 1, 1], splits, group=g)  # type: ignore[arg-type]


# -- roots given twice -------------------------------------------------------------------------
@pytest.mark.parametrize("call", [
    lambda g: tandem.broadcast(f(2), src=0, group=g, group_src=0),
    lambda g: tandem.reduce(f(2), dst=0, group=g, group_dst=0),
    lambda g: tandem.gather(f(2), None, dst=0, group=g, group_dst=0),
    lambda g: tandem.scatter(f(2), None, src=0, group=g, group_src=0),
    lambda g: tandem.isend(f(2), 0, group=g, group_dst=0),
    lambda g: tandem.irecv(f(2), 0, group=g, group_src=0),
], ids=["broadcast", "reduce", "gather", "scatter", "isend", "irecv"])
def test_a_root_given_both_as_global_and_group_rank_is_refused(g: ProcessGroup, call) -> None:
    with pytest.raises(ArgumentError, match="not both"):
        call(g)


def test_every_refusal_is_a_tandem_error() -> None:
    assert issubclass(ArgumentError, TandemError) and issubclass(ArgumentError, ValueError)


# -- flags: a value that is not True or False is refused, never taken for its truth ------------
ASYNC_CALLS = {
    "broadcast": lambda g, a: tandem.broadcast(f(2), 1, group=g, async_op=a),
    "all_reduce": lambda g, a: tandem.all_reduce(f(2), group=g, async_op=a),
    "all_reduce_coalesced": lambda g, a: tandem.all_reduce_coalesced([f(2)], group=g,
                                                                     async_op=a),
    "reduce": lambda g, a: tandem.reduce(f(2), 1, group=g, async_op=a),
    "all_gather": lambda g, a: tandem.all_gather([f(2) for _ in range(P)], f(2), group=g,
                                                 async_op=a),
    "all_gather_into_tensor": lambda g, a: tandem.all_gather_into_tensor(f(2 * P), f(2), group=g,
                                                                         async_op=a),
    "gather": lambda g, a: tandem.gather(f(2), [f(2) for _ in range(P)], 1, group=g, async_op=a),
    "scatter": lambda g, a: tandem.scatter(f(2), [f(2)] * P, 1, group=g, async_op=a),
    "reduce_scatter": lambda g, a: tandem.reduce_scatter(f(2), [f(2)] * P, group=g, async_op=a),
    "reduce_scatter_tensor": lambda g, a: tandem.reduce_scatter_tensor(f(2), f(2 * P), group=g,
                                                                       async_op=a),
    "all_to_all": lambda g, a: tandem.all_to_all([f(1) for _ in range(P)], [f(1)] * P, group=g,
                                                 async_op=a),
    "all_to_all_single": lambda g, a: tandem.all_to_all_single(f(P), f(P), group=g, async_op=a),
    "barrier": lambda g, a: tandem.barrier(group=g, async_op=a),
}
NOT_BOOLS = ["no", 0, 1, None, torch.tensor(True)]


def test_every_public_function_taking_async_op_is_checked_here() -> None:
    import inspect

    taking = {name for name in tandem.__all__ if inspect.isfunction(getattr(tandem, name, None))
              and "async_op" in inspect.signature(getattr(tandem, name)).parameters}
    aliases = {"all_gather_single", "reduce_scatter_single"}  # the same functions as two above
    assert taking - aliases == set(ASYNC_CALLS), taking ^ set(ASYNC_CALLS)


@pytest.mark.parametrize("value", NOT_BOOLS, ids=repr)
@pytest.mark.parametrize("call", list(ASYNC_CALLS))
def test_an_async_op_that_is_not_a_bool_is_refused_naming_it(g: ProcessGroup, call: str,
                                                             value: object) -> None:
    with pytest.raises(ArgumentError, match=f"{call}: async_op must be True or False, got "
                                            f"{type(value).__name__}"):
        ASYNC_CALLS[call](g, value)


@pytest.mark.parametrize("name", ["send_object_list", "recv_object_list"])
def test_a_use_batch_that_is_not_a_bool_is_refused_naming_it(g: ProcessGroup, name: str) -> None:
    with pytest.raises(ArgumentError, match=f"{name}: use_batch must be True or False, got str"):
        getattr(tandem, name)([1], 0, group=g, use_batch="no")


@pytest.mark.parametrize("flag", ["use_local_synchronization", "sort_ranks"])
def test_new_group_flags_that_are_not_bools_are_refused_naming_them(solo: None, flag: str) -> None:
    with pytest.raises(ArgumentError, match=f"new_group: {flag} must be True or False, got str"):
        tandem.new_group([0], **{flag: "no"})  # type: ignore[arg-type]
