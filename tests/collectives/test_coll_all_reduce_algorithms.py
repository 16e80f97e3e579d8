"""all_reduce algorithms (naive, doubling, ring) on threads over the loopback transport.

Every algorithm must agree *exactly* with the naive oracle and with the reduction
computed locally, for every world size, tensor size, reduce op and dtype; and every
rank must end up with bit-identical bytes. The ring runs with 4 KiB chunks so that
chunking and pipelining are exercised at modest sizes.
"""

from __future__ import annotations

import time

import pytest
import torch

import tandem
from tandem.config import Settings
from tandem.errors import ArgumentError
from tandem.testing import run_threads

from _coll_util import (ALGORITHMS, DTYPES, OPS, assert_equal, op_defined, rank_input,
                        reduce_locally, same_bits, short)

pytestmark = pytest.mark.timeout(60)

SMALL_CHUNKS = Settings(chunk_bytes=4096)


def _all_reduce(group, x: torch.Tensor, op: tandem.ReduceOp, algorithm: str) -> torch.Tensor:
    group.algorithm_override["all_reduce"] = algorithm
    out = x.clone()
    tandem.all_reduce(out, op=op, group=group)
    return out


def _run_cases(world_size: int, cases: list[tuple[str, torch.dtype, int]],
               algorithms: list[str]) -> list[list[dict[str, torch.Tensor]]]:
    """Per rank, per case: {algorithm: result} on the same inputs (naive included)."""

    def body(group):
        out = []
        for op, dtype, numel in cases:
            x = rank_input(op, dtype, numel, group.rank())
            redop = getattr(tandem.ReduceOp, op)
            out.append({a: _all_reduce(group, x, redop, a) for a in ["naive", *algorithms]})
        return out

    return run_threads(world_size, body, settings=SMALL_CHUNKS)


def _check(results, world_size: int, cases, algorithms: list[str]) -> None:
    for c, (op, dtype, numel) in enumerate(cases):
        inputs = [rank_input(op, dtype, numel, r) for r in range(world_size)]
        expected = reduce_locally(op, inputs)
        for rank in range(world_size):
            got = results[rank][c]
            for a in ["naive", *algorithms]:
                what = f"rank {rank}: all_reduce({a}, {op}, {short(dtype)}, {numel} elements)"
                assert_equal(got[a], expected, f"{what} vs the locally computed reduction")
                assert_equal(got[a], got["naive"], f"{what} vs the naive oracle")


@pytest.mark.parametrize("numel", [0, 1, 7, 1000, 100003])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_reduce_agrees_with_naive_oracle(algorithm: str, world_size: int, numel: int) -> None:
    cases = [("SUM", torch.float32, numel), ("MAX", torch.int32, numel),
             ("AVG", torch.float64, numel)]
    results = _run_cases(world_size, cases, [algorithm])
    _check(results, world_size, cases, [algorithm])


DEFINED = [(op, d) for op in OPS for d in DTYPES if op_defined(op, d)]
UNDEFINED = [(op, d) for op in OPS for d in DTYPES if not op_defined(op, d)]


@pytest.mark.parametrize("op,dtype", DEFINED, ids=[f"{o}-{short(d)}" for o, d in DEFINED])
def test_every_reduce_op_and_dtype_is_exact_with_every_algorithm(op: str, dtype: torch.dtype) -> None:
    # 3 ranks: not a power of two, so doubling folds a rank; 2053 elements: the ring
    # splits 8-byte segments into two 4 KiB chunks.
    cases = [(op, dtype, 2053)]
    results = _run_cases(3, cases, ["doubling", "ring"])
    _check(results, 3, cases, ["doubling", "ring"])


@pytest.mark.parametrize("op,dtype", UNDEFINED, ids=[f"{o}-{short(d)}" for o, d in UNDEFINED])
def test_undefined_reduce_op_for_dtype_raises_argument_error(op: str, dtype: torch.dtype) -> None:
    def body(group):
        with pytest.raises(ArgumentError) as info:
            tandem.all_reduce(torch.zeros(4, dtype=dtype), op=getattr(tandem.ReduceOp, op),
                              group=group)
        return str(info.value)

    for message in run_threads(2, body):
        assert op in message and str(dtype) in message, message


# Dtypes torch has but whose kernels lack add/min/max (uint16/32/64) or nearly everything
# (complex32, float8): tandem must refuse them up front, not fail inside the algorithm on
# the ranks that combine while the others wait for a result that never comes.
EXOTIC = [(op, d) for d in (torch.uint16, torch.uint32, torch.uint64, torch.complex32,
                            torch.float8_e4m3fn, torch.float8_e5m2)
          for op in ("SUM", "MIN", "MAX", "AVG")]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("op,dtype", EXOTIC, ids=[f"{o}-{short(d)}" for o, d in EXOTIC])
def test_reduce_op_without_a_torch_kernel_for_dtype_raises_argument_error(op, dtype) -> None:
    def body(group):
        group.algorithm_override["all_reduce"] = "naive"
        with pytest.raises(ArgumentError, match=op):
            tandem.all_reduce(torch.zeros(4, dtype=dtype), op=getattr(tandem.ReduceOp, op),
                              group=group)

    run_threads(2, body, op_timeout=3.0)


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_results_are_bit_identical_on_every_rank(algorithm: str, world_size: int) -> None:
    # random floats: the order of additions matters, so only the same order on every
    # rank gives the same bits
    def inputs(rank: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(rank)
        return [torch.randn(100003, generator=g), torch.randn(5003, generator=g).bfloat16()]

    def body(group):
        return [_all_reduce(group, x, tandem.ReduceOp.SUM, algorithm)
                for x in inputs(group.rank())]

    results = run_threads(world_size, body, settings=SMALL_CHUNKS)
    for rank in range(1, world_size):
        for got, ref in zip(results[rank], results[0]):
            assert same_bits(got, ref), (
                f"rank {rank}: all_reduce({algorithm}, SUM, {short(got.dtype)}) differs from "
                f"rank 0 in {(got != ref).sum().item()} elements")
    exact = torch.stack([inputs(r)[0].double() for r in range(world_size)]).sum(0).float()
    torch.testing.assert_close(results[0][0], exact)


@pytest.mark.parametrize("world_size", [1, 3, 4])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_custom_reduce_op_runs_with_every_algorithm(algorithm: str, world_size: int) -> None:
    gcd = tandem.ReduceOp.custom(torch.gcd, "GCD")  # associative, commutative and exact
    inputs = [torch.randint(1, 10**6, (3001,), generator=torch.Generator().manual_seed(r)) * 6
              for r in range(world_size)]

    def body(group):
        return _all_reduce(group, inputs[group.rank()], gcd, algorithm)

    expected = inputs[0]
    for x in inputs[1:]:
        expected = torch.gcd(expected, x)
    for rank, got in enumerate(run_threads(world_size, body, settings=SMALL_CHUNKS)):
        assert_equal(got, expected, f"rank {rank}: all_reduce({algorithm}, custom GCD)")


def test_custom_reduce_op_needs_a_callable() -> None:
    with pytest.raises(ArgumentError, match="callable"):
        tandem.ReduceOp.custom(42)  # type: ignore[arg-type]


def test_all_reduce_of_non_contiguous_tensor_writes_back_in_place() -> None:
    def body(group):
        base = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (group.rank() + 1)
        view = base.t()  # non-contiguous
        tandem.all_reduce(view, group=group)
        return base

    expected = torch.arange(12, dtype=torch.float32).reshape(3, 4) * 3
    for rank, got in enumerate(run_threads(2, body)):
        assert_equal(got, expected, f"rank {rank}: all_reduce of a transposed view")


def test_default_algorithm_choice_agrees_with_oracle_above_and_below_ring_threshold() -> None:
    def body(group):
        out = []
        for numel in (10, 400000):  # 40 B (doubling) and 1.6 MB (ring) in float32
            x = torch.full((numel,), float(group.rank() + 1))
            tandem.all_reduce(x, group=group)
            out.append(x)
        return out

    for rank, got in enumerate(run_threads(3, body)):
        for t in got:
            assert_equal(t, torch.full_like(t, 6.0), f"rank {rank}: all_reduce({t.numel()})")


def _mismatch_outcomes(calls) -> list[tuple[str, str, float]]:
    """Run ``calls[rank](group)`` on 2 threads; each rank's (error type, message, seconds)."""

    def body(group):
        start = time.monotonic()
        try:
            calls[group.rank()](group)
        except Exception as exc:  # noqa: BLE001 - the outcome is the subject of the test
            return type(exc).__name__, str(exc), time.monotonic() - start
        return "no error", "", time.monotonic() - start

    return run_threads(2, body, op_timeout=2.0)


def test_ranks_calling_same_collective_with_different_dtypes_get_a_mismatch_error() -> None:
    outcomes = _mismatch_outcomes([
        lambda g: tandem.all_reduce(torch.ones(8), group=g),
        lambda g: tandem.all_reduce(torch.ones(8, dtype=torch.int32), group=g)])
    for rank, (kind, message, _) in enumerate(outcomes):
        assert kind == "CollectiveMismatchError", f"rank {rank}: {kind}: {message}"
        assert "float32[8]" in message and "int32[8]" in message, f"rank {rank}: {message}"


MISMATCH_BUG = ("transport/base.py Mailbox compares signatures only when a message's key "
                "(group, seq, step) matches a posted receive; collectives whose algorithms use "
                "different step numbers never meet, so both ranks wait for the op timeout "
                "(1800 s by default) and report CollectiveTimeoutError instead of a mismatch")


def test_ranks_choosing_different_algorithms_get_a_mismatch_error() -> None:
    def call(algorithm):
        def run(g):
            g.algorithm_override["all_reduce"] = algorithm
            tandem.all_reduce(torch.ones(8), group=g)
        return run

    outcomes = _mismatch_outcomes([call("ring"), call("doubling")])
    for rank, (kind, message, _) in enumerate(outcomes):
        assert kind == "CollectiveMismatchError", f"rank {rank}: {kind}: {message}"
        assert "algorithm=ring" in message and "algorithm=doubling" in message, message


def test_ranks_calling_different_collectives_get_a_mismatch_error() -> None:
    outcomes = _mismatch_outcomes([lambda g: tandem.all_reduce(torch.ones(8), group=g),
                                   lambda g: tandem.broadcast(torch.ones(8), src=0, group=g)])
    for rank, (kind, message, _) in enumerate(outcomes):
        assert kind == "CollectiveMismatchError", f"rank {rank}: {kind}: {message}"
        assert "all_reduce" in message and "broadcast" in message, f"rank {rank}: {message}"


def test_unknown_algorithm_name_raises_argument_error_listing_known_ones() -> None:
    def body(group):
        group.algorithm_override["all_reduce"] = "bogus"
        with pytest.raises(ArgumentError, match="'bogus'.*naive"):
            tandem.all_reduce(torch.ones(2), group=group)

    run_threads(2, body)


def test_failing_custom_op_reports_the_error_to_every_rank_instead_of_hanging_them() -> None:
    # naive: only rank 0 combines; if its combine raises, rank 1 must not sit waiting for
    # a result that never comes until the op timeout
    def bad(a, b):
        raise ValueError("boom")

    def body(group):
        group.algorithm_override["all_reduce"] = "naive"
        start = time.monotonic()
        try:
            tandem.all_reduce(torch.ones(4), op=tandem.ReduceOp.custom(bad), group=group)
        except Exception as exc:  # noqa: BLE001 - the outcome is the subject of the test
            return type(exc).__name__, str(exc), time.monotonic() - start
        return None

    outcomes = run_threads(2, body, op_timeout=10.0, timeout=30.0)
    assert outcomes[0] is not None and "boom" in outcomes[0][1], f"rank 0: {outcomes[0]}"
    assert outcomes[1] is not None, "rank 1: all_reduce returned although rank 0 failed"
    kind, message, elapsed = outcomes[1]
    assert kind != "CollectiveTimeoutError" and elapsed < 5.0, (  # half the op timeout
        f"rank 1: got {kind} after {elapsed:.1f}s ({message}); expected rank 0's failure "
        f"to be reported at once")


@pytest.mark.parametrize("where", ["setting", "override"])
def test_an_unknown_algorithm_is_refused_naming_where_it_was_asked_for(where: str) -> None:
    def body(group):
        if where == "override":
            group.algorithm_override["all_reduce"] = "abc"
        with pytest.raises(ArgumentError) as info:
            tandem.all_reduce(torch.ones(4), group=group)
        return str(info.value)

    source = "TANDEM_ALGORITHM" if where == "setting" else "algorithm_override['all_reduce']"
    for message in run_threads(2, body, settings=Settings(algorithm="abc")):
        assert f"{source}='abc'" in message and "known: auto, " in message, message
