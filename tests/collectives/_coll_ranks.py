"""Bodies of the spawned ranks of the collectives tests (importable by the children).

:func:`tandem_and_gloo` runs every case of :data:`CASES` twice in each rank: once with
``tandem`` and once with ``torch.distributed`` on gloo, *with the same code* (the APIs
are the same, so a case takes the library as ``lib.dist``). The test process then
compares the two results rank by rank.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable

import torch
import torch.distributed as td

import tandem


class Lib:
    """One library's view of the job: ``dist`` (tandem or torch.distributed) and groups."""

    def __init__(self, dist: Any, rank: int, world_size: int) -> None:
        self.dist = dist
        self.rank = rank
        self.ws = world_size
        # the subgroup leaves rank 0 out, so global and group ranks differ
        self.sub_ranks = list(range(1, world_size))
        self.sub = dist.new_group(self.sub_ranks)
        self.in_sub = rank in self.sub_ranks


def _data(rank: int, *shape: int, dtype: torch.dtype = torch.float32, salt: int = 0) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    t = torch.arange(n, dtype=torch.float64) * (rank + 2) + 100 * rank + salt
    return t.reshape(shape).to(dtype)


Case = Callable[[Lib], Any]
CASES: dict[str, Case] = {}
# Cases gloo cannot answer: {name: (why, answer(rank, world_size))}; only tandem runs them
# and the answer computed locally is the reference.
LOCAL_ANSWERS: dict[str, tuple[str, Callable[[int, int], Any]]] = {}


def case(fn: Case) -> Case:
    CASES[fn.__name__] = fn
    return fn


def local_case(why: str, answer: Callable[[int, int], Any]) -> Callable[[Case], Case]:
    def register(fn: Case) -> Case:
        LOCAL_ANSWERS[fn.__name__] = (why, answer)
        return case(fn)
    return register


_NON_CONTIGUOUS = "gloo writes a non-contiguous output as if it were contiguous (corrupts it)"


# -- broadcast --------------------------------------------------------------------------
@case
def broadcast_multidim_from_last_rank(lib: Lib) -> Any:
    t = _data(lib.rank, 2, 3, 5)
    lib.dist.broadcast(t, src=lib.ws - 1)
    return t


@case
def broadcast_non_contiguous(lib: Lib) -> Any:
    base = _data(lib.rank, 4, 6)
    view = base.t()
    lib.dist.broadcast(view, src=0)
    return base


@case
def broadcast_zero_size(lib: Lib) -> Any:
    t = torch.empty(0, 3)
    lib.dist.broadcast(t, src=0)
    return t


@case
def broadcast_int64_large(lib: Lib) -> Any:
    t = _data(lib.rank, 70000, dtype=torch.int64)  # 560 kB: above the inline-send limit
    lib.dist.broadcast(t, src=lib.ws - 1)
    return t


@case
def broadcast_subgroup_global_src(lib: Lib) -> Any:
    if not lib.in_sub:
        return None
    t = _data(lib.rank, 5)
    lib.dist.broadcast(t, src=lib.ws - 1, group=lib.sub)  # a global rank
    return t


# -- all_reduce -------------------------------------------------------------------------
def _all_reduce(lib: Lib, op: str, dtype: torch.dtype, shape=(3, 7)) -> torch.Tensor:
    t = _data(lib.rank, *shape, dtype=dtype) % 5 + 1
    lib.dist.all_reduce(t, op=getattr(lib.dist.ReduceOp, op))
    return t


@case
def all_reduce_sum_float32(lib: Lib) -> Any:
    return _all_reduce(lib, "SUM", torch.float32)


@case
def all_reduce_product_float64(lib: Lib) -> Any:
    return _all_reduce(lib, "PRODUCT", torch.float64)


@case
def all_reduce_min_int32(lib: Lib) -> Any:
    return _all_reduce(lib, "MIN", torch.int32)


@case
def all_reduce_max_int64(lib: Lib) -> Any:
    return _all_reduce(lib, "MAX", torch.int64)


@case
def all_reduce_avg_float32(lib: Lib) -> Any:
    return _all_reduce(lib, "AVG", torch.float32)


@case
def all_reduce_band_int64(lib: Lib) -> Any:
    return _all_reduce(lib, "BAND", torch.int64)


@case
def all_reduce_bor_uint8(lib: Lib) -> Any:
    return _all_reduce(lib, "BOR", torch.uint8)


@case
def all_reduce_bxor_int32(lib: Lib) -> Any:
    return _all_reduce(lib, "BXOR", torch.int32)


@case
def all_reduce_sum_int8_wraps(lib: Lib) -> Any:
    t = torch.full((9,), 100, dtype=torch.int8)
    lib.dist.all_reduce(t)
    return t


@case
def all_reduce_sum_bfloat16(lib: Lib) -> Any:
    return _all_reduce(lib, "SUM", torch.bfloat16)


@case
def all_reduce_sum_float16(lib: Lib) -> Any:
    return _all_reduce(lib, "SUM", torch.float16)


@case
def all_reduce_sum_complex64(lib: Lib) -> Any:
    t = torch.complex(_data(lib.rank, 6), -_data(lib.rank, 6, salt=1))
    lib.dist.all_reduce(t)
    return t


@case
def all_reduce_max_bool(lib: Lib) -> Any:
    t = torch.tensor([lib.rank == 0, False, True, lib.rank == lib.ws - 1])
    lib.dist.all_reduce(t, op=lib.dist.ReduceOp.MAX)
    return t


@case
def all_reduce_min_bool(lib: Lib) -> Any:
    t = torch.tensor([lib.rank == 0, False, True, lib.rank != lib.ws - 1])
    lib.dist.all_reduce(t, op=lib.dist.ReduceOp.MIN)
    return t


@case
def all_reduce_large_sum_float32(lib: Lib) -> Any:
    # 400 kB: tandem's ring; integer values keep the sum exact in any order
    return _all_reduce(lib, "SUM", torch.float32, shape=(100003,))


def _all_reduce_non_contiguous_answer(rank: int, ws: int) -> torch.Tensor:
    base = _data(rank, 5, 4)
    base[:, 1::2] = sum(_data(r, 5, 4)[:, 1::2] for r in range(ws))
    return base


@local_case(_NON_CONTIGUOUS, _all_reduce_non_contiguous_answer)
def all_reduce_non_contiguous(lib: Lib) -> Any:
    base = _data(lib.rank, 5, 4)
    lib.dist.all_reduce(base[:, 1::2])
    return base


@case
def all_reduce_zero_size(lib: Lib) -> Any:
    t = torch.empty(0)
    lib.dist.all_reduce(t)
    return t


@case
def all_reduce_subgroup(lib: Lib) -> Any:
    if not lib.in_sub:
        return None
    t = _data(lib.rank, 4)
    lib.dist.all_reduce(t, group=lib.sub)
    return t


def _non_finite(rank: int) -> torch.Tensor:
    """NaN and infinities where some ranks hold them and others finite values."""
    t = _data(rank, 6)
    t[rank % 6] = float("nan")
    t[5] = float("inf") if rank % 2 else 1.0
    t[4] = float("-inf")
    return t


def _nan_apart(t: torch.Tensor) -> list[torch.Tensor]:
    """Where ``t`` is NaN, and its other values: NaN equals nothing, not even itself."""
    return [t.isnan(), torch.where(t.isnan(), torch.zeros_like(t), t)]


@case
def all_reduce_sum_passes_nan_and_inf_through(lib: Lib) -> Any:
    t = _non_finite(lib.rank)
    lib.dist.all_reduce(t)
    return _nan_apart(t)


@case
def broadcast_passes_nan_and_inf_through(lib: Lib) -> Any:
    t = _non_finite(lib.ws - 1) if lib.rank == lib.ws - 1 else torch.zeros(6)
    lib.dist.broadcast(t, src=lib.ws - 1)
    return _nan_apart(t)


def _max_with_nan(rank: int, world_size: int) -> Any:
    out = _non_finite(0)
    for q in range(1, world_size):
        out = torch.maximum(out, _non_finite(q))
    return _nan_apart(out)


@local_case("gloo's MAX keeps or drops a NaN by the order it meets it (std::max); tandem "
            "propagates it as torch.maximum does, the same on every rank", _max_with_nan)
def all_reduce_max_propagates_nan(lib: Lib) -> Any:
    t = _non_finite(lib.rank)
    lib.dist.all_reduce(t, op=lib.dist.ReduceOp.MAX)
    return _nan_apart(t)


# -- reduce ----------------------------------------------------------------------------
@case
def reduce_sum_to_rank_1(lib: Lib) -> Any:
    t = _data(lib.rank, 2, 4)
    lib.dist.reduce(t, dst=1)
    return t if lib.rank == 1 else None  # other ranks' tensors are unspecified


@case
def reduce_max_to_rank_0(lib: Lib) -> Any:
    t = _data(lib.rank, 6, dtype=torch.int32) % 7
    lib.dist.reduce(t, dst=0, op=lib.dist.ReduceOp.MAX)
    return t if lib.rank == 0 else None


@case
def reduce_subgroup_global_dst(lib: Lib) -> Any:
    if not lib.in_sub:
        return None
    t = _data(lib.rank, 3)
    lib.dist.reduce(t, dst=lib.ws - 1, group=lib.sub)
    return t if lib.rank == lib.ws - 1 else None


# -- all_gather ------------------------------------------------------------------------
@case
def all_gather_multidim(lib: Lib) -> Any:
    out = [torch.empty(2, 3) for _ in range(lib.ws)]
    lib.dist.all_gather(out, _data(lib.rank, 2, 3))
    return out


@case
def all_gather_non_contiguous_outputs(lib: Lib) -> Any:
    bases = [torch.zeros(3, 2) for _ in range(lib.ws)]
    lib.dist.all_gather([b.t() for b in bases], _data(lib.rank, 2, 3))
    return bases


@case
def all_gather_zero_size(lib: Lib) -> Any:
    out = [torch.empty(0) for _ in range(lib.ws)]
    lib.dist.all_gather(out, torch.empty(0))
    return out


@case
def all_gather_subgroup(lib: Lib) -> Any:
    if not lib.in_sub:
        return None
    out = [torch.empty(3, dtype=torch.int64) for _ in lib.sub_ranks]
    lib.dist.all_gather(out, _data(lib.rank, 3, dtype=torch.int64), group=lib.sub)
    return out


@case
def all_gather_into_tensor_concatenated(lib: Lib) -> Any:
    out = torch.empty(lib.ws * 4)
    lib.dist.all_gather_into_tensor(out, _data(lib.rank, 4))
    return out


@local_case("gloo takes only the concatenated output shape (world_size * rows, ...)",
            lambda rank, ws: torch.stack([_data(r, 2, 3, dtype=torch.float64) for r in range(ws)]))
def all_gather_into_tensor_stacked(lib: Lib) -> Any:
    out = torch.empty(lib.ws, 2, 3, dtype=torch.float64)
    lib.dist.all_gather_into_tensor(out, _data(lib.rank, 2, 3, dtype=torch.float64))
    return out


# -- gather / scatter ------------------------------------------------------------------
@case
def gather_to_last_rank(lib: Lib) -> Any:
    dst = lib.ws - 1
    out = [torch.empty(2, 2) for _ in range(lib.ws)] if lib.rank == dst else None
    lib.dist.gather(_data(lib.rank, 2, 2), out, dst=dst)
    return out


@case
def gather_subgroup_global_dst(lib: Lib) -> Any:
    if not lib.in_sub:
        return None
    dst = lib.ws - 1
    out = [torch.empty(3) for _ in lib.sub_ranks] if lib.rank == dst else None
    lib.dist.gather(_data(lib.rank, 3), out, dst=dst, group=lib.sub)
    return out


@case
def scatter_from_last_rank(lib: Lib) -> Any:
    src = lib.ws - 1
    ins = [_data(100 + i, 2, 3) for i in range(lib.ws)] if lib.rank == src else None
    out = torch.empty(2, 3)
    lib.dist.scatter(out, ins, src=src)
    return out


@local_case(_NON_CONTIGUOUS, lambda rank, ws: _data(100 + rank, 3, 2).t().contiguous())
def scatter_non_contiguous_output(lib: Lib) -> Any:
    ins = [_data(100 + i, 3, 2) for i in range(lib.ws)] if lib.rank == 0 else None
    base = torch.zeros(2, 3)
    lib.dist.scatter(base.t(), ins, src=0)
    return base


@case
def scatter_subgroup_global_src(lib: Lib) -> Any:
    if not lib.in_sub:
        return None
    src = lib.ws - 1
    ins = [_data(100 + i, 4) for i in lib.sub_ranks] if lib.rank == src else None
    out = torch.empty(4)
    lib.dist.scatter(out, ins, src=src, group=lib.sub)
    return out


# -- reduce_scatter --------------------------------------------------------------------
@case
def reduce_scatter_sum(lib: Lib) -> Any:
    out = torch.empty(2, 3)
    lib.dist.reduce_scatter(out, [_data(lib.rank, 2, 3, salt=i) for i in range(lib.ws)])
    return out


@case
def reduce_scatter_max_int32(lib: Lib) -> Any:
    out = torch.empty(5, dtype=torch.int32)
    ins = [_data(lib.rank, 5, dtype=torch.int32, salt=7 * i) % 11 for i in range(lib.ws)]
    lib.dist.reduce_scatter(out, ins, op=lib.dist.ReduceOp.MAX)
    return out


@case
def reduce_scatter_tensor_sum(lib: Lib) -> Any:
    out = torch.empty(4)
    lib.dist.reduce_scatter_tensor(out, _data(lib.rank, lib.ws * 4))
    return out


@case
def reduce_scatter_tensor_large(lib: Lib) -> Any:
    out = torch.empty(50001)
    lib.dist.reduce_scatter_tensor(out, _data(lib.rank, lib.ws * 50001))
    return out


# -- all_to_all ------------------------------------------------------------------------
@local_case("gloo's all_to_all needs tensors of one size",
            lambda rank, ws: [_data(j, j + rank + 1, salt=10 * rank) for j in range(ws)])
def all_to_all_uneven_list(lib: Lib) -> Any:
    # rank i sends (i + j + 1) elements to rank j
    ins = [_data(lib.rank, lib.rank + j + 1, salt=10 * j) for j in range(lib.ws)]
    outs = [torch.empty(j + lib.rank + 1) for j in range(lib.ws)]
    lib.dist.all_to_all(outs, ins)
    return outs


@case
def all_to_all_single_even(lib: Lib) -> Any:
    out = torch.empty(lib.ws * 3, dtype=torch.int64)
    lib.dist.all_to_all_single(out, _data(lib.rank, lib.ws * 3, dtype=torch.int64))
    return out


@case
def all_to_all_single_even_multidim(lib: Lib) -> Any:
    out = torch.empty(lib.ws * 2, 3)
    lib.dist.all_to_all_single(out, _data(lib.rank, lib.ws * 2, 3))
    return out


@case
def all_to_all_single_uneven(lib: Lib) -> Any:
    # rank i sends (i + j) rows of 2 to rank j, so rank j receives (i + j) from each i
    in_splits = [lib.rank + j for j in range(lib.ws)]
    out_splits = [i + lib.rank for i in range(lib.ws)]
    src = _data(lib.rank, sum(in_splits), 2)
    out = torch.empty(sum(out_splits), 2)
    lib.dist.all_to_all_single(out, src, out_splits, in_splits)
    return out


@case
def all_to_all_single_zero_size(lib: Lib) -> Any:
    out = torch.empty(0)
    lib.dist.all_to_all_single(out, torch.empty(0))
    return out


# -- barrier, async, p2p -----------------------------------------------------------------
@case
def barrier_waits_for_the_last_rank(lib: Lib) -> Any:
    if lib.rank == 0:
        time.sleep(0.3)
    start = time.monotonic()
    lib.dist.barrier()
    waited = time.monotonic() - start
    return lib.rank == 0 or waited > 0.2  # the others cannot leave before rank 0 arrives


@case
def monitored_barrier_returns(lib: Lib) -> Any:
    return lib.dist.monitored_barrier(timeout=datetime.timedelta(seconds=10))


@case
def async_all_reduce_future_value(lib: Lib) -> Any:
    t = _data(lib.rank, 4)
    work = lib.dist.all_reduce(t, async_op=True)
    value = work.get_future().wait()
    work.wait()
    return [work.is_completed(), value]


@case
def send_recv_by_tag_out_of_order(lib: Lib) -> Any:
    if lib.rank == 0:
        works = [lib.dist.isend(_data(0, 3, salt=tag), dst=1, tag=tag) for tag in (1, 2)]
        for w in works:
            w.wait()
        return None
    if lib.rank == 1:
        second, first = torch.empty(3), torch.empty(3)
        lib.dist.recv(second, src=0, tag=2)
        lib.dist.recv(first, src=0, tag=1)
        return [first, second]
    return None


@case
def recv_from_any_source_returns_sender(lib: Lib) -> Any:
    if lib.rank == lib.ws - 1:
        lib.dist.send(_data(lib.rank, 2), dst=0, tag=3)
        return None
    if lib.rank == 0:
        t = torch.empty(2)
        sender = lib.dist.recv(t, tag=3)
        return [sender, t]
    return None


@case
def same_tag_messages_arrive_in_send_order(lib: Lib) -> Any:
    if lib.rank == 1:
        works = [lib.dist.isend(torch.full((4,), float(i)), dst=0, tag=7) for i in range(5)]
        for w in works:
            w.wait()
        return None
    if lib.rank == 0:
        outs = [torch.empty(4) for _ in range(5)]
        works = [lib.dist.irecv(t, src=1, tag=7) for t in outs]
        for w in works:
            w.wait()
        return outs
    return None


@case
def batch_isend_irecv_ring_exchange(lib: Lib) -> Any:
    nxt, prv = (lib.rank + 1) % lib.ws, (lib.rank - 1) % lib.ws
    got = torch.empty(3)
    ops = [lib.dist.P2POp(lib.dist.isend, _data(lib.rank, 3), nxt),
           lib.dist.P2POp(lib.dist.irecv, got, prv)]
    for w in lib.dist.batch_isend_irecv(ops):
        w.wait()
    return got


# -- objects -----------------------------------------------------------------------------
@case
def broadcast_object_list_from_last_rank(lib: Lib) -> Any:
    objs = [{"rank": lib.rank, "x": [1, 2]}, "text", 3.5] if lib.rank == lib.ws - 1 else [None] * 3
    lib.dist.broadcast_object_list(objs, src=lib.ws - 1)
    return objs


@case
def all_gather_object_uneven_sizes(lib: Lib) -> Any:
    out = [None] * lib.ws
    lib.dist.all_gather_object(out, {"rank": lib.rank, "pad": "x" * (50 * lib.rank)})
    return out


@case
def gather_object_to_rank_1(lib: Lib) -> Any:
    out = [None] * lib.ws if lib.rank == 1 else None
    lib.dist.gather_object(("r", lib.rank, list(range(lib.rank))), out, dst=1)
    return out


@case
def scatter_object_list_from_rank_0(lib: Lib) -> Any:
    out = [None]
    ins = [{"to": i, "data": "y" * i} for i in range(lib.ws)] if lib.rank == 0 else None
    lib.dist.scatter_object_list(out, ins, src=0)
    return out


@case
def send_recv_object_list(lib: Lib) -> Any:
    if lib.rank == 0:
        lib.dist.send_object_list([{"a": 1}, (2, 3), "four"], dst=1)
        return None
    if lib.rank == 1:
        out = [None, None, None]
        lib.dist.recv_object_list(out, src=0)
        return out
    return None


@case
def broadcast_object_list_subgroup_global_src(lib: Lib) -> Any:
    if not lib.in_sub:
        return None
    objs = ["from", lib.rank] if lib.rank == lib.ws - 1 else [None, None]
    lib.dist.broadcast_object_list(objs, src=lib.ws - 1, group=lib.sub)
    return objs


# -- runner ----------------------------------------------------------------------------
def encode(value: Any) -> Any:
    """Results as plain data (tensors by dtype, shape and values) for the test process."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.tolist())
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    return value


def tandem_and_gloo(rank: int, world_size: int, gloo_file: str) -> dict[str, dict[str, Any]]:
    """Run every case with both libraries; return {case: {"tandem": ..., "gloo": ...}}."""
    td.init_process_group("gloo", init_method=f"file://{gloo_file}", rank=rank,
                          world_size=world_size, timeout=datetime.timedelta(seconds=30))
    try:
        libs = {"tandem": Lib(tandem, rank, world_size), "gloo": Lib(td, rank, world_size)}
        results: dict[str, dict[str, Any]] = {}
        for name, fn in CASES.items():
            results[name] = {}
            for lib_name, lib in libs.items():
                if lib_name == "gloo" and name in LOCAL_ANSWERS:
                    continue
                try:
                    results[name][lib_name] = encode(fn(lib))
                except Exception as exc:  # noqa: BLE001 - compared in the test process
                    results[name][lib_name] = ("error", f"{type(exc).__name__}: {exc}")
        return results
    finally:
        td.destroy_process_group()


# -- groups (4 ranks) ----------------------------------------------------------------------
def _error(call: Callable[[], Any]) -> tuple[str, str] | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test process checks type and message
        return type(exc).__name__, str(exc)
    return None


def groups_behaviour(rank: int, world_size: int) -> dict[str, Any]:
    """Observations of new_group / new_subgroups / rank translation / non-members on a rank."""
    out: dict[str, Any] = {}
    odd = tandem.new_group([3, 1], group_desc="odd")  # given unsorted
    out["odd_ranks"] = tandem.get_process_group_ranks(odd)
    out["odd_rank_and_size"] = (tandem.get_rank(odd), tandem.get_world_size(odd))
    out["odd_group_rank_of_3"] = tandem.get_group_rank(odd, 3)
    out["odd_global_rank_of_0"] = tandem.get_global_rank(odd, 0)
    out["odd_group_rank_of_2"] = _error(lambda: tandem.get_group_rank(odd, 2))
    if rank in (1, 3):
        t = torch.full((2,), float(rank))
        tandem.all_reduce(t, group=odd)
        out["odd_all_reduce"] = t.tolist()
        b = torch.full((1,), float(rank))
        tandem.broadcast(b, src=3, group=odd)  # src is a global rank
        out["odd_broadcast_from_3"] = b.tolist()
    else:
        t = torch.ones(2)
        out["nonmember_calls"] = {
            "all_reduce": _error(lambda: tandem.all_reduce(t, group=odd)),
            "broadcast": _error(lambda: tandem.broadcast(t, src=1, group=odd)),
            "barrier": _error(lambda: tandem.barrier(group=odd)),
            "all_gather_object": _error(lambda: tandem.all_gather_object([None] * 2, 1,
                                                                         group=odd)),
            "send": _error(lambda: tandem.send(t, dst=1, group=odd)),
            "irecv": _error(lambda: tandem.irecv(t, src=1, group=odd)),
        }

    mine, pairs = tandem.new_subgroups(group_size=2)
    out["subgroup_ranks"] = tandem.get_process_group_ranks(mine)
    out["all_subgroup_ranks"] = [tandem.get_process_group_ranks(g) for g in pairs]
    t = torch.full((1,), float(rank))
    tandem.all_reduce(t, group=mine)
    out["subgroup_all_reduce"] = t.item()

    # overlapping groups driven concurrently: even ranks issue on A first, odd ranks on B
    # first, all asynchronously, interleaved with the default group
    group_a = tandem.new_group([0, 1, 2])
    group_b = tandem.new_group([1, 2, 3])
    plan: list[tuple[str, Any]] = [("A", group_a), ("B", group_b)]
    if rank % 2:
        plan.reverse()
    works: list[tandem.Work] = []
    tensors: dict[str, torch.Tensor] = {}
    for i in range(8):
        for name, g in plan + [("W", None)]:
            if g is not None and rank not in tandem.get_process_group_ranks(g):
                continue
            x = torch.full((3000,), float(rank + 10 * i))
            work = tandem.all_reduce(x, group=g, async_op=True)
            assert work is not None
            works.append(work)
            tensors[f"{name}{i}"] = x
    for w in works:
        w.wait()
    out["concurrent"] = {k: v[0].item() for k, v in tensors.items()}

    tandem.destroy_process_group(mine)
    out["after_destroy"] = _error(lambda: tandem.all_reduce(torch.ones(1), group=mine))
    tandem.barrier()
    return out


def aliased_arguments(rank: int, world_size: int) -> dict[str, Any]:
    """Calls whose input shares memory with an output (an in-place all_to_all_single, an
    input that is another rank's slot of the output list, a tensor listed twice), on the
    job's own backend; the test compares each with the answer computed locally."""
    out: dict[str, Any] = {}
    t = torch.arange(world_size * 2.0) + 10 * rank
    tandem.all_to_all_single(t, t)
    out["all_to_all_single_in_place"] = t.tolist()

    big = 1 << 16  # past the small-message paths
    for name, n in (("all_gather_input_in_other_slot", 3),
                    ("all_gather_input_in_other_slot_big", big)):
        mine = torch.full((n,), float(rank + 1))
        slots = [torch.zeros(n) for _ in range(world_size)]
        slots[(rank + 1) % world_size] = mine
        tandem.all_gather(slots, mine)
        out[name] = [s.unique().tolist() for s in slots]

    x = torch.ones(4)
    tandem.all_reduce_coalesced([x, x])
    out["all_reduce_coalesced_same_tensor_twice"] = x.tolist()

    n = big
    whole = torch.zeros(world_size * n)
    part = whole.narrow(0, ((rank + 1) % world_size) * n, n)  # another rank's chunk
    part.fill_(rank + 1)
    tandem.all_gather_into_tensor(whole, part)
    out["all_gather_into_tensor_input_in_other_chunk"] = [
        whole[i * n:(i + 1) * n].unique().tolist() for i in range(world_size)]

    ins = [torch.full((n,), 10.0 * rank + i) for i in range(world_size)]
    outs = ins[1:] + ins[:1]  # each output is the input meant for another rank
    tandem.all_to_all(outs, ins)
    out["all_to_all_outputs_are_other_inputs"] = [o.unique().tolist() for o in outs]

    ins = [torch.full((3,), float(10 * rank + i)) for i in range(world_size)]
    res = ins[(rank + 1) % world_size]  # the output is the part meant for the next rank
    tandem.reduce_scatter(res, ins)
    out["reduce_scatter_output_is_an_input"] = res.tolist()
    return out
