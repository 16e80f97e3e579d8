"""Custom reduce ops whose code is the same on every rank but whose behaviour is not.

``SCALE = rank + 1; f = lambda a, b: a * SCALE + b`` gave each rank its own answer.
A custom op's fingerprint covers what it reads (globals its code names, closure cells,
defaults, a callable object's or bound method's attributes; tensors by value), so such
an op is a ``CollectiveMismatchError`` before anything is combined. What the
fingerprint cannot see (state changed after the op was made) is caught by comparing a
checksum of an all-reduce's result across ranks, unless the op is declared pure.
"""

from __future__ import annotations

import functools
import time
import types
from typing import Any, Callable

import pytest
import torch

import tandem
from tandem.collectives.reduce_op import fingerprint
from tandem.errors import ArgumentError
from tandem.testing import launch

pytestmark = pytest.mark.timeout(240)

BACKENDS = ["tcp", "shm"]
OP_TIMEOUT = 40.0  # an undetected disagreement ends with this

SCALE = 1.0  # a module global the ops below read


def _scaled(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * SCALE + b


def _with_globals(fn: Callable[..., Any], **values: Any) -> Callable[..., Any]:
    """``fn``'s code over a copy of its module's globals with ``values`` changed: what the
    same source gives on a rank where those globals differ."""
    space = dict(fn.__globals__, **values)
    return types.FunctionType(fn.__code__, space, fn.__name__, fn.__defaults__, fn.__closure__)


class Scaler:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * self.scale + b

    def combine(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * self.scale + b


class SlottedScaler:
    __slots__ = ("scale",)

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * self.scale + b


def _closing_over(weight: torch.Tensor) -> Callable[..., Any]:
    return lambda a, b: a * weight + b


# (what differs, the op as rank 0 makes it, the op as rank 1 makes it)
PER_RANK = {
    "a global its code names": (_with_globals(_scaled, SCALE=1.0),
                                _with_globals(_scaled, SCALE=2.0)),
    "a callable object's attribute": (Scaler(1.0), Scaler(2.0)),
    "a slotted object's attribute": (SlottedScaler(1.0), SlottedScaler(2.0)),
    "a bound method's object": (Scaler(1.0).combine, Scaler(2.0).combine),
    "a tensor it closes over": (_closing_over(torch.ones(3)), _closing_over(torch.full((3,), 2.0))),
    "a partial's keyword argument": (functools.partial(torch.add, alpha=1.0),
                                    functools.partial(torch.add, alpha=2.0)),
    "a default": ((lambda a, b, k=1.0: a * k + b), (lambda a, b, k=2.0: a * k + b)),
}


@pytest.mark.parametrize("case", list(PER_RANK))
def test_fingerprint_differs_when_what_the_op_reads_differs(case: str) -> None:
    mine, theirs = PER_RANK[case]
    assert fingerprint(mine) != fingerprint(theirs), case


@pytest.mark.parametrize("case", list(PER_RANK))
def test_fingerprint_is_the_same_for_the_same_values(case: str) -> None:
    mine, _ = PER_RANK[case]
    assert fingerprint(mine) == fingerprint(mine), case
    if case == "a tensor it closes over":
        assert fingerprint(_closing_over(torch.ones(3))) == fingerprint(mine)


def test_fingerprint_survives_cycles_and_unhashable_state() -> None:
    s = Scaler(1.0)
    s.self_ref = s  # type: ignore[attr-defined]
    s.table = {object(): 1, "k": [1, {2, 3}]}  # type: ignore[attr-defined]
    assert fingerprint(s) == fingerprint(s)


def test_pure_ops_are_compared_by_their_code_alone() -> None:
    one = tandem.ReduceOp.custom(_with_globals(_scaled, SCALE=1.0), "X", pure=True)
    two = tandem.ReduceOp.custom(_with_globals(_scaled, SCALE=2.0), "X", pure=True)
    assert one.sig == two.sig
    checked = tandem.ReduceOp.custom(_with_globals(_scaled, SCALE=1.0), "X")
    assert checked.sig != one.sig  # ranks must agree on whether results are compared


def test_pure_must_be_a_bool() -> None:
    with pytest.raises(ArgumentError, match="pure must be True or False"):
        tandem.ReduceOp.custom(torch.maximum, "M", pure="yes")  # type: ignore[arg-type]


# -- across processes ----------------------------------------------------------------------
def _op_reading_a_per_rank_global(rank: int) -> Any:
    global SCALE
    SCALE = float(rank + 1)
    return tandem.ReduceOp.custom(_scaled, "X")


def _op_changed_after_it_was_made(rank: int, pure: bool = False) -> Any:
    scaler = Scaler(1.0)
    op = tandem.ReduceOp.custom(scaler, "X", pure=pure)
    scaler.scale = float(rank + 1)  # after the fingerprint was taken
    return op


def _all_reduce(op: Any, g: Any = None) -> Any:
    t = torch.ones(3)
    tandem.all_reduce(t, op=op, group=g)
    return t.tolist()


def _coalesced(op: Any, g: Any) -> Any:
    ts = [torch.ones(3), torch.ones(2)]
    tandem.all_reduce_coalesced(ts, op=op, group=g)
    return [t.tolist() for t in ts]


def _reduce(op: Any, g: Any) -> Any:
    t = torch.ones(3)
    tandem.reduce(t, dst=1, op=op, group=g)
    return t.tolist()


def _reduce_scatter(op: Any, g: Any) -> Any:
    out = torch.empty(2)
    tandem.reduce_scatter(out, [torch.ones(2), torch.ones(2)], op=op, group=g)
    return out.tolist()


CASES: dict[str, tuple[Callable[[int], Any], Callable[[Any, Any], Any]]] = {
    "all_reduce-global": (_op_reading_a_per_rank_global, _all_reduce),
    "reduce-global": (_op_reading_a_per_rank_global, _reduce),
    "reduce_scatter-global": (_op_reading_a_per_rank_global, _reduce_scatter),
    "all_reduce_coalesced-global": (_op_reading_a_per_rank_global, _coalesced),
    "all_reduce-changed-later": (_op_changed_after_it_was_made, _all_reduce),
    "all_reduce_coalesced-changed-later": (_op_changed_after_it_was_made, _coalesced),
}


def _run(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    out: dict[str, dict[str, Any]] = {}
    for name, (make, call) in CASES.items():
        g = tandem.new_group([0, 1])  # each case on a fresh group: a mismatch aborts it
        op = make(rank)
        start = time.monotonic()
        try:
            out[name] = {"ok": True, "value": call(op, g)}
        except Exception as exc:  # noqa: BLE001 - described for the test
            out[name] = {"ok": False, "type": type(exc).__name__, "msg": str(exc)}
        out[name]["elapsed"] = time.monotonic() - start
        tandem.barrier()  # the next case starts together on both ranks
    # an op declared pure is trusted: its result is not compared
    out["pure"] = {"value": _all_reduce(_op_changed_after_it_was_made(rank, pure=True))}
    honest = tandem.ReduceOp.custom(lambda a, b: torch.maximum(a, b), "HONEST")
    t = torch.full((2,), float(rank))
    tandem.all_reduce(t, op=honest)
    out["honest"] = {"value": t.tolist()}
    return out


@pytest.fixture(scope="module", params=BACKENDS)
def seen(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, dict[str, Any]]]]:
    outcomes = launch(2, _run, backend=request.param, timeout=200,
                      op_timeout=OP_TIMEOUT)
    bad = [f"--- rank {o.rank} ({o.error_type}) ---\n{o.error}" for o in outcomes if not o.ok]
    assert not bad, "\n".join(bad)
    return request.param, [o.value for o in outcomes]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.procs
def test_per_rank_behaviour_is_a_mismatch_on_every_rank(seen, case: str) -> None:
    backend, results = seen
    for rank in range(2):
        r = results[rank][case]
        assert not r["ok"], f"{backend}: rank {rank} completed {case} with {r['value']}"
        assert r["type"] == "CollectiveMismatchError", (
            f"{backend}: rank {rank} raised {r['type']}: {r['msg']}")
        assert "custom:X" in r["msg"] or "custom reduce op custom:X" in r["msg"], r["msg"]
        assert r["elapsed"] < OP_TIMEOUT / 4, (backend, rank, r["elapsed"], r["msg"])


@pytest.mark.procs
def test_a_result_mismatch_names_the_op_and_each_ranks_checksum(seen) -> None:
    backend, results = seen
    for rank in range(2):
        msg = results[rank]["all_reduce-changed-later"]["msg"]
        assert "custom reduce op custom:X gave different results" in msg, (backend, msg)
        assert "rank(s) 0 got checksum" in msg and "rank(s) 1 got checksum" in msg, msg
        assert "pure=True" in msg, msg


@pytest.mark.procs
def test_an_op_declared_pure_is_not_compared(seen) -> None:
    backend, results = seen
    # each rank's own scale applied to the lower rank's data: they differ, as declared
    assert results[0]["pure"]["value"] != results[1]["pure"]["value"], backend


@pytest.mark.procs
def test_an_honest_custom_op_still_works(seen) -> None:
    backend, results = seen
    for rank in range(2):
        assert results[rank]["honest"]["value"] == [1.0, 1.0], (backend, rank, results[rank])
