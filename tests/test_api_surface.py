"""Porting is one changed import: tandem exposes torch.distributed's names, and every
argument torch documents is either honoured or refused with a message naming it.

The audit at the bottom ties each torch parameter of each public function to evidence:
a behaviour check below that passes it by keyword (found in the check's source) and
verifies its effect, or a refusal case that must raise ``ArgumentError`` naming it. A
parameter torch adds in a later version fails ``test_every_torch_parameter_is_audited``
until someone decides which it is.

Behaviour checks run on two thread ranks over the loopback transport, on ``rev``: the
group of global ranks [1, 0], so a global rank and a group rank always differ and a
swapped ``src``/``group_src`` shows.
"""

from __future__ import annotations

import datetime
import inspect
import math
import re
import tempfile
import warnings
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as tdist

import tandem
from tandem.collectives.group import ProcessGroup
from tandem.collectives.world import default_group
from tandem.errors import ArgumentError, StateError
from tandem.testing import run_threads

pytestmark = pytest.mark.timeout(120)

# the c10d functions a training script uses, with the parameters it may pass by name
FUNCTIONS = [
    "init_process_group", "destroy_process_group", "is_initialized", "is_available",
    "get_rank", "get_world_size", "get_backend", "new_group", "new_subgroups",
    "new_subgroups_by_enumeration", "get_group_rank", "get_global_rank",
    "get_process_group_ranks",
    "broadcast", "all_reduce", "all_reduce_coalesced", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_single", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list",
]
CLASSES = ["ReduceOp", "P2POp", "Work", "TCPStore", "FileStore", "HashStore", "PrefixStore",
           "Store", "Backend", "ProcessGroup"]


def test_all_lists_exactly_the_public_names() -> None:
    missing = [n for n in tandem.__all__ if not hasattr(tandem, n)]
    assert not missing, f"tandem.__all__ names that do not exist: {missing}"
    assert len(set(tandem.__all__)) == len(tandem.__all__), "duplicate names in __all__"


@pytest.mark.parametrize("name", FUNCTIONS + CLASSES)
def test_torch_name_exists(name: str) -> None:
    assert hasattr(tdist, name), f"test list is wrong: torch.distributed has no {name}"
    assert name in tandem.__all__, f"tandem does not export torch.distributed.{name}"


def _torch_parameters(name: str) -> list[str]:
    return [p for p in inspect.signature(getattr(tdist, name)).parameters if not p.startswith("_")]


@pytest.mark.parametrize("name", FUNCTIONS)
def test_parameters_accept_torch_call_styles(name: str) -> None:
    """Every parameter torch documents can be passed to tandem by the same name and position."""
    theirs = inspect.signature(getattr(tdist, name)).parameters
    ours = inspect.signature(getattr(tandem, name)).parameters
    missing = [p for p in _torch_parameters(name) if p not in ours]
    assert not missing, f"tandem.{name} lacks torch's parameters {missing}"
    positional = [p for p, v in theirs.items() if v.kind in
                  (v.POSITIONAL_ONLY, v.POSITIONAL_OR_KEYWORD) and not p.startswith("_")]
    ours_positional = [p for p, v in ours.items() if v.kind in
                       (v.POSITIONAL_ONLY, v.POSITIONAL_OR_KEYWORD)]
    assert ours_positional[: len(positional)] == positional, (
        f"tandem.{name} positional order {ours_positional} differs from torch's {positional}")


def test_reduce_ops_match_torch_names() -> None:
    for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"):
        assert hasattr(tdist.ReduceOp, op)
        assert getattr(tandem.ReduceOp, op).name == op


# -- behaviour on two thread ranks -----------------------------------------------------------
def _rev(g: ProcessGroup) -> ProcessGroup:
    return ProcessGroup(g.transport, [1, 0], 9, "rev", g.timeout, g.settings, "loopback")


def _full(rank: int, n: int = 2) -> torch.Tensor:
    return torch.full((n,), float(rank + 1))


def _done(work: Any) -> None:
    assert isinstance(work, tandem.Work), f"async_op=True returned {work!r}"
    work.wait()


def check_broadcast(r: int, rev: ProcessGroup) -> None:
    t = _full(r)
    assert tandem.broadcast(tensor=t, src=0, group=rev, async_op=False) is None
    assert t.tolist() == [1.0, 1.0]  # from global rank 0
    t = _full(r)
    _done(tandem.broadcast(tensor=t, group=rev, async_op=True, group_src=0))
    assert t.tolist() == [2.0, 2.0]  # group rank 0 is global rank 1


def check_all_reduce(r: int, rev: ProcessGroup) -> None:
    t = _full(r)
    _done(tandem.all_reduce(tensor=t, op=tandem.ReduceOp.MAX, group=rev, async_op=True))
    assert t.tolist() == [2.0, 2.0]


def check_all_reduce_coalesced(r: int, rev: ProcessGroup) -> None:
    a, b = _full(r), _full(r, 3)
    _done(tandem.all_reduce_coalesced(tensors=[a, b], op=tandem.ReduceOp.MIN, group=rev,
                                      async_op=True))
    assert a.tolist() == [1.0] * 2 and b.tolist() == [1.0] * 3


def check_reduce(r: int, rev: ProcessGroup) -> None:
    t = _full(r)
    tandem.reduce(tensor=t, dst=1, op=tandem.ReduceOp.PRODUCT, group=rev, async_op=False)
    assert t.tolist() == ([2.0, 2.0] if r == 1 else [1.0, 1.0])
    t = _full(r)
    _done(tandem.reduce(tensor=t, group=rev, async_op=True, group_dst=1))  # global rank 0
    assert t.tolist() == ([3.0, 3.0] if r == 0 else [2.0, 2.0])


def check_all_gather(r: int, rev: ProcessGroup) -> None:
    out = [torch.empty(2), torch.empty(2)]
    _done(tandem.all_gather(tensor_list=out, tensor=_full(r), group=rev, async_op=True))
    assert [o[0].item() for o in out] == [2.0, 1.0]  # in group-rank order


def check_all_gather_into_tensor(r: int, rev: ProcessGroup) -> None:
    out = torch.empty(4)
    _done(tandem.all_gather_into_tensor(output_tensor=out, input_tensor=_full(r), group=rev,
                                        async_op=True))
    assert out.tolist() == [2.0, 2.0, 1.0, 1.0]


def check_all_gather_single(r: int, rev: ProcessGroup) -> None:
    out = torch.empty(2, 2)  # the stacked form
    _done(tandem.all_gather_single(output_tensor=out, input_tensor=_full(r), group=rev,
                                   async_op=True))
    assert out.tolist() == [[2.0, 2.0], [1.0, 1.0]]


def check_gather(r: int, rev: ProcessGroup) -> None:
    out = [torch.empty(2), torch.empty(2)] if r == 0 else None
    tandem.gather(tensor=_full(r), gather_list=out, dst=0, group=rev, async_op=False)
    if out is not None:
        assert [o[0].item() for o in out] == [2.0, 1.0]
    out = [torch.empty(2), torch.empty(2)] if r == 0 else None
    _done(tandem.gather(tensor=_full(r), gather_list=out, group=rev, async_op=True,
                        group_dst=1))
    if out is not None:
        assert [o[0].item() for o in out] == [2.0, 1.0]


def check_scatter(r: int, rev: ProcessGroup) -> None:
    t = torch.empty(2)
    parts = [torch.full((2,), 10.0), torch.full((2,), 20.0)] if r == 1 else None
    tandem.scatter(tensor=t, scatter_list=parts, src=1, group=rev, async_op=False)
    assert t.tolist() == ([10.0] * 2 if r == 1 else [20.0] * 2)  # part i to group rank i
    t = torch.empty(2)
    _done(tandem.scatter(tensor=t, scatter_list=parts, group=rev, async_op=True, group_src=0))
    assert t.tolist() == ([10.0] * 2 if r == 1 else [20.0] * 2)


def check_reduce_scatter(r: int, rev: ProcessGroup) -> None:
    out = torch.empty(2)
    _done(tandem.reduce_scatter(output=out, input_list=[_full(r), _full(r) * 10],
                                op=tandem.ReduceOp.SUM, group=rev, async_op=True))
    assert out.tolist() == ([3.0] * 2 if r == 1 else [30.0] * 2)


def check_reduce_scatter_tensor(r: int, rev: ProcessGroup) -> None:
    out = torch.empty(1)
    _done(tandem.reduce_scatter_tensor(output=out, input=torch.tensor([1.0, 2.0]) * (r + 1),
                                       op=tandem.ReduceOp.MAX, group=rev, async_op=True))
    assert out.tolist() == ([2.0] if r == 1 else [4.0])


def check_reduce_scatter_single(r: int, rev: ProcessGroup) -> None:
    out = torch.empty(1)
    tandem.reduce_scatter_single(output=out, input=torch.tensor([1.0, 2.0]) * (r + 1),
                                 op=tandem.ReduceOp.SUM, group=rev, async_op=False)
    assert out.tolist() == ([3.0] if r == 1 else [6.0])


def check_all_to_all(r: int, rev: ProcessGroup) -> None:
    out = [torch.empty(1), torch.empty(1)]
    _done(tandem.all_to_all(output_tensor_list=out,
                            input_tensor_list=[torch.tensor([10.0 * r]), torch.tensor([10.0 * r + 1])],
                            group=rev, async_op=True))
    mine = 1 - r  # my group rank
    assert [o.item() for o in out] == [10.0 * 1 + mine, 10.0 * 0 + mine]


def check_all_to_all_single(r: int, rev: ProcessGroup) -> None:
    src = torch.arange(3.0) + 10 * r
    # rows to group ranks 0 (global 1) and 1 (global 0), and rows from them
    sizes_in, sizes_out = ([1, 2], [1, 2]) if r == 0 else ([2, 1], [2, 1])
    out = torch.empty(3)
    _done(tandem.all_to_all_single(output=out, input=src, output_split_sizes=sizes_out,
                                   input_split_sizes=sizes_in, group=rev, async_op=True))
    assert out.tolist() == ([12.0, 1.0, 2.0] if r == 0 else [10.0, 11.0, 0.0])


def check_barrier(r: int, rev: ProcessGroup) -> None:
    _done(tandem.barrier(group=rev, async_op=True, timeout=datetime.timedelta(seconds=5)))


def check_monitored_barrier(r: int, rev: ProcessGroup) -> None:
    assert tandem.monitored_barrier(group=rev, timeout=5.0, wait_all_ranks=True) is None


def check_send(r: int, rev: ProcessGroup) -> None:  # and recv: the two sides of one exchange
    if r == 0:
        tandem.send(tensor=_full(r), dst=1, group=rev, tag=7)
        tandem.send(tensor=_full(r) * 3, group=rev, tag=8, group_dst=0)
        return
    late, early = torch.empty(2), torch.empty(2)
    assert tandem.recv(tensor=late, src=0, group=rev, tag=8) == 0  # tags match, not order
    assert tandem.recv(tensor=early, group=rev, tag=7, group_src=1) == 0
    assert early.tolist() == [1.0, 1.0] and late.tolist() == [3.0, 3.0]


check_recv = check_send


def check_isend(r: int, rev: ProcessGroup) -> None:  # and irecv
    if r == 0:
        _done(tandem.isend(tensor=_full(r), dst=1, group=rev, tag=3))
        _done(tandem.isend(tensor=_full(r), group=rev, tag=4, group_dst=0))
        return
    a, b = torch.empty(2), torch.empty(2)
    _done(tandem.irecv(tensor=a, src=0, group=rev, tag=4))
    _done(tandem.irecv(tensor=b, group=rev, tag=3, group_src=1))
    assert a.tolist() == b.tolist() == [1.0, 1.0]


check_irecv = check_isend


def check_batch_isend_irecv(r: int, rev: ProcessGroup) -> None:
    got = torch.empty(2)
    ops = [tandem.P2POp(tandem.isend, _full(r), 1 - r, rev, tag=5),
           tandem.P2POp(tandem.irecv, got, 1 - r, rev, tag=5)]
    for w in tandem.batch_isend_irecv(p2p_op_list=ops):
        w.wait()
    assert got.tolist() == _full(1 - r).tolist()


def check_broadcast_object_list(r: int, rev: ProcessGroup) -> None:
    objs: list[Any] = [{"from": r}, None]
    tandem.broadcast_object_list(object_list=objs, src=1, group=rev, device="cpu")
    assert objs[0] == {"from": 1}
    objs = [r]
    tandem.broadcast_object_list(object_list=objs, group=rev, group_src=1)
    assert objs == [0]


def check_all_gather_object(r: int, rev: ProcessGroup) -> None:
    out: list[Any] = [None, None]
    tandem.all_gather_object(object_list=out, obj=("rank", r), group=rev)
    assert out == [("rank", 1), ("rank", 0)]


def check_gather_object(r: int, rev: ProcessGroup) -> None:
    out: list[Any] | None = [None, None] if r == 1 else None
    tandem.gather_object(obj=r, object_gather_list=out, dst=1, group=rev)
    assert out in (None, [1, 0])
    out = [None, None] if r == 1 else None
    tandem.gather_object(obj=r * 2, object_gather_list=out, group=rev, group_dst=0)
    assert out in (None, [2, 0])


def check_scatter_object_list(r: int, rev: ProcessGroup) -> None:
    out: list[Any] = [None]
    tandem.scatter_object_list(scatter_object_output_list=out,
                               scatter_object_input_list=["a", "b"] if r == 0 else None,
                               src=0, group=rev)
    assert out == ["b" if r == 0 else "a"]
    tandem.scatter_object_list(scatter_object_output_list=out,
                               scatter_object_input_list=["c", "d"] if r == 1 else None,
                               group=rev, group_src=0)
    assert out == ["d" if r == 0 else "c"]


def check_send_object_list(r: int, rev: ProcessGroup) -> None:  # and recv_object_list
    if r == 0:
        tandem.send_object_list(object_list=[{"x": 1}, "y"], dst=1, group=rev, device="cpu")
        tandem.send_object_list(object_list=[[2]], group=rev, group_dst=0, use_batch=True)
        return
    objs: list[Any] = [None, None]
    assert tandem.recv_object_list(object_list=objs, src=0, group=rev, device="cpu") == 0
    assert objs == [{"x": 1}, "y"]
    one: list[Any] = [None]
    assert tandem.recv_object_list(object_list=one, group=rev, group_src=1, use_batch=True) == 0
    assert one == [[2]]


check_recv_object_list = check_send_object_list


def check_get_rank(r: int, rev: ProcessGroup) -> None:
    assert tandem.get_rank(group=rev) == 1 - r


def check_get_world_size(r: int, rev: ProcessGroup) -> None:
    assert tandem.get_world_size(group=rev) == 2


def check_get_backend(r: int, rev: ProcessGroup) -> None:
    assert tandem.get_backend(group=rev) == "loopback"


def check_get_group_rank(r: int, rev: ProcessGroup) -> None:
    assert tandem.get_group_rank(group=rev, global_rank=1) == 0


def check_get_global_rank(r: int, rev: ProcessGroup) -> None:
    assert tandem.get_global_rank(group=rev, group_rank=1) == 0


def check_get_process_group_ranks(r: int, rev: ProcessGroup) -> None:
    assert tandem.get_process_group_ranks(group=rev) == [1, 0]


THREAD_CHECKS: dict[str, Callable[[int, ProcessGroup], None]] = {
    name.removeprefix("check_"): fn for name, fn in dict(globals()).items()
    if name.startswith("check_")}


@pytest.mark.parametrize("name", sorted(THREAD_CHECKS))
def test_behaviour_on_a_group_whose_ranks_are_reversed(name: str) -> None:
    def body(g: ProcessGroup) -> None:
        THREAD_CHECKS[name](g.group_rank, _rev(g))

    run_threads(2, body, timeout=60, op_timeout=20)


# -- behaviour of the job-level functions, in a one-rank job in this process -------------------
@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TANDEM_SECRET", "api-surface-test")
    yield
    if tandem.is_initialized():
        tandem.destroy_process_group()


def job_init_process_group() -> None:
    tandem.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=42),
                              world_size=1, rank=0, store=tandem.HashStore(),
                              group_name="main", pg_options=None, device_id="cpu")
    assert tandem.is_initialized() and tandem.is_available()
    g = default_group()
    assert (g.group_name, g.timeout, tandem.get_backend()) == ("main", 42.0, "auto")
    tandem.destroy_process_group()
    with tempfile.TemporaryDirectory() as tmp:
        tandem.init_process_group("tcp", init_method=f"file://{tmp}/s?rank=0&world_size=1")
        assert tandem.get_world_size() == 1 and tandem.get_rank() == 0


def job_destroy_process_group() -> None:
    tandem.init_process_group("tcp", store=tandem.HashStore(), rank=0, world_size=1)
    sub = tandem.new_group([0])
    tandem.destroy_process_group(group=sub)
    with pytest.raises(StateError, match="destroyed"):
        tandem.all_reduce(torch.ones(1), group=sub)
    tandem.all_reduce(torch.ones(1))  # the default group lives on
    tandem.destroy_process_group()
    assert not tandem.is_initialized()


def job_new_group() -> None:
    tandem.init_process_group("tcp", store=tandem.HashStore(), rank=0, world_size=1)
    g = tandem.new_group(ranks=[0], timeout=7.0, backend="gloo", pg_options=None,
                         use_local_synchronization=True, group_desc="mine", device_id="cpu",
                         sort_ranks=False)
    assert isinstance(g, ProcessGroup) and (g.group_name, g.timeout, g.ranks) == ("mine", 7.0, [0])


def job_new_subgroups() -> None:
    tandem.init_process_group("tcp", store=tandem.HashStore(), rank=0, world_size=1)
    parent = tandem.new_group([0])
    mine, every = tandem.new_subgroups(group_size=1, group=parent, timeout=3.0, backend="tcp",
                                       pg_options=None, group_desc="sub")
    assert isinstance(mine, ProcessGroup) and len(every) == 1
    assert (mine.group_name, mine.timeout) == ("sub", 3.0)


def job_new_subgroups_by_enumeration() -> None:
    tandem.init_process_group("tcp", store=tandem.HashStore(), rank=0, world_size=1)
    mine, every = tandem.new_subgroups_by_enumeration(
        ranks_per_subgroup_list=[[0]], timeout=4.0, backend=None, pg_options=None,
        group_desc="enum")
    assert isinstance(mine, ProcessGroup) and every == [mine]
    assert (mine.group_name, mine.timeout) == ("enum", 4.0)


JOB_CHECKS = {name.removeprefix("job_"): fn for name, fn in dict(globals()).items()
              if name.startswith("job_")}


@pytest.mark.parametrize("name", sorted(JOB_CHECKS))
def test_behaviour_in_a_one_rank_job(secret: None, name: str) -> None:
    JOB_CHECKS[name]()


# -- refusals ----------------------------------------------------------------------------------
def _solo() -> None:
    tandem.init_process_group("tcp", store=tandem.HashStore(), rank=0, world_size=1)


def _init(**kw: Any) -> Callable[[], None]:
    return lambda: tandem.init_process_group("tcp", store=tandem.HashStore(), rank=0,
                                             world_size=1, **kw)


def _in_job(call: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        _solo()
        call()
    return run


# function -> parameter -> calls that must raise ArgumentError naming the parameter
REFUSED: dict[str, dict[str, list[Callable[[], Any]]]] = {
    "init_process_group": {
        "pg_options": [_init(pg_options=object())],
        "device_id": [_init(device_id="cuda:0"), _init(device_id=0), _init(device_id="meta")],
        "timeout": [_init(timeout=math.nan), _init(timeout=-1)],
        "backend": [lambda: tandem.init_process_group("nccl", store=tandem.HashStore(),
                                                      rank=0, world_size=1)],
    },
    "new_group": {
        "pg_options": [_in_job(lambda: tandem.new_group([0], pg_options=object()))],
        "device_id": [_in_job(lambda: tandem.new_group([0], device_id="cuda"))],
        "backend": [_in_job(lambda: tandem.new_group([0], backend="nccl")),
                    _in_job(lambda: tandem.new_group([0], backend="shm"))],
        "timeout": [_in_job(lambda: tandem.new_group([0], timeout=math.inf))],
        "use_local_synchronization": [
            _in_job(lambda: tandem.new_group([0], use_local_synchronization="yes"))],
    },
    "new_subgroups": {
        "pg_options": [_in_job(lambda: tandem.new_subgroups(1, pg_options=object()))],
        "group_size": [_in_job(lambda: tandem.new_subgroups(group_size=0))],
    },
    "new_subgroups_by_enumeration": {
        "pg_options": [_in_job(lambda: tandem.new_subgroups_by_enumeration(
            [[0]], pg_options=object()))],
        "ranks_per_subgroup_list": [_in_job(lambda: tandem.new_subgroups_by_enumeration([]))],
    },
    "barrier": {"device_ids": [_in_job(lambda: tandem.barrier(device_ids=[0]))]},
    "broadcast_object_list": {
        "device": [_in_job(lambda: tandem.broadcast_object_list([1], device="cuda"))]},
    "send_object_list": {
        "device": [_in_job(lambda: tandem.send_object_list([1], dst=0, device="cuda:1"))]},
    "recv_object_list": {
        "device": [_in_job(lambda: tandem.recv_object_list([1], src=0, device="cuda"))]},
}

_REFUSALS = [(f, p, i) for f, params in REFUSED.items() for p, calls in params.items()
             for i in range(len(calls))]


@pytest.mark.parametrize("function,parameter,index", _REFUSALS,
                         ids=[f"{f}-{p}-{i}" for f, p, i in _REFUSALS])
def test_refused_arguments_raise_naming_the_argument(secret: None, function: str,
                                                     parameter: str, index: int) -> None:
    with pytest.raises(ArgumentError) as info:
        REFUSED[function][parameter][index]()
    message = str(info.value)
    assert parameter in message, (
        f"{function}: refusing {parameter} should name it: {message}")


# -- the audit -----------------------------------------------------------------------------------
NO_PARAMETERS = {"is_initialized", "is_available"}


def _shown(name: str) -> set[str]:
    """Parameters the behaviour checks of ``name`` pass by keyword."""
    sources = [inspect.getsource(fn) for table in (THREAD_CHECKS, JOB_CHECKS)
               for key, fn in table.items() if key == name]
    return {p for p in _torch_parameters(name)
            if any(re.search(rf"\b{p}=", src) for src in sources)}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_every_torch_parameter_is_audited(name: str) -> None:
    if name in NO_PARAMETERS:
        assert _torch_parameters(name) == []
        return
    assert name in THREAD_CHECKS or name in JOB_CHECKS, f"no behaviour check for {name}"
    unaccounted = set(_torch_parameters(name)) - _shown(name) - set(REFUSED.get(name, {}))
    assert not unaccounted, (
        f"tandem.{name}: torch's parameters {sorted(unaccounted)} are neither shown honoured "
        f"by a behaviour check (passed by keyword) nor refused with a message")


# -- post-local SGD and model averaging: torch.distributed.{optim,algorithms} names ----------
with warnings.catch_warnings():  # torch.distributed.optim scripts its functional optimizers
    warnings.simplefilter("ignore", DeprecationWarning)
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_local
    from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
    from torch.distributed.algorithms.model_averaging import (
        hierarchical_model_averager as torch_hier,
    )
    from torch.distributed.algorithms.model_averaging import utils as torch_avg_utils
    from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGD

from tandem.algorithms.ddp_comm_hooks import post_localSGD_hook as local_hook  # noqa: E402
from tandem.algorithms.model_averaging import averagers, utils as avg_utils  # noqa: E402
from tandem.algorithms.model_averaging.hierarchical_model_averager import (  # noqa: E402
    HierarchicalModelAverager,
)
from tandem.optim import PostLocalSGDOptimizer  # noqa: E402

# audited name -> torch's callable, whose parameters each need a check or a refusal
LOCAL_SGD: dict[str, Callable[..., Any]] = {
    "ModelAverager": torch_averagers.ModelAverager.__init__,
    "PeriodicModelAverager": torch_averagers.PeriodicModelAverager.__init__,
    "PeriodicModelAverager.average_parameters":
        torch_averagers.PeriodicModelAverager.average_parameters,
    "HierarchicalModelAverager": torch_hier.HierarchicalModelAverager.__init__,
    "HierarchicalModelAverager.average_parameters":
        torch_hier.HierarchicalModelAverager.average_parameters,
    "average_parameters": torch_avg_utils.average_parameters,
    "get_params_to_average": torch_avg_utils.get_params_to_average,
    "average_parameters_or_parameter_groups":
        torch_avg_utils.average_parameters_or_parameter_groups,
    "PostLocalSGDState": torch_local.PostLocalSGDState.__init__,
    "PostLocalSGDState.maybe_increase_iter": torch_local.PostLocalSGDState.maybe_increase_iter,
    "post_localSGD_hook": torch_local.post_localSGD_hook,
    **{f"PostLocalSGDOptimizer{m}": getattr(TorchPostLocalSGD, m.lstrip(".") or "__init__")
       for m in ("", ".load_state_dict", ".zero_grad", ".add_param_group")},
}


def _param(r: int) -> torch.nn.Parameter:
    p = torch.nn.Parameter(_full(r))
    p.grad = torch.zeros(2)
    return p


def _averaged_at(averager: Any, r: int, calls: int) -> list[bool]:
    """For each call of ``averager.average_parameters``: did it average (1.5 on both)?"""
    p, out = _param(r), []
    for _ in range(calls):
        with torch.no_grad():
            p.fill_(r + 1)
        averager.average_parameters(params=[p])
        out.append(p.tolist() == [1.5, 1.5])
    return out


def local_sgd_averagers(r: int, rev: ProcessGroup) -> None:
    periodic = averagers.PeriodicModelAverager(period=2, warmup_steps=1, process_group=rev)
    assert _averaged_at(periodic, r, 5) == [False, True, False, True, False]
    assert periodic.step == 5 and periodic.process_group is rev

    class Always(averagers.ModelAverager):
        def average_parameters(self, params: Any) -> None:
            avg_utils.average_parameters_or_parameter_groups(params, self.process_group)

    assert Always(process_group=rev).process_group is rev
    # both levels span rev here (subgroups: tests/algorithms/test_post_local_sgd.py)
    hier = HierarchicalModelAverager(period_group_size_dict={2: 2, 3: 2}, warmup_steps=3,
                                     process_group=rev)
    assert _averaged_at(hier, r, 7) == [False, False, False, True, True, False, True]


def local_sgd_utils(r: int, rev: ProcessGroup) -> None:
    p, idle = _param(r), torch.nn.Parameter(torch.zeros(1))  # idle: no .grad
    assert avg_utils.get_params_to_average(params=[{"params": [p, idle]}]) == [p]
    assert avg_utils.get_params_to_average(params=[idle, p]) == [p]
    avg_utils.average_parameters(params=iter([p]), process_group=rev)
    assert p.tolist() == [1.5, 1.5]
    p = _param(r)
    avg_utils.average_parameters_or_parameter_groups(params=[{"params": [p, idle]}],
                                                     process_group=rev)
    assert p.tolist() == [1.5, 1.5] and idle.tolist() == [0.0]


class _Bucket:
    def __init__(self, r: int, last: bool) -> None:
        self.buf, self.last = _full(r), last

    def buffer(self) -> torch.Tensor:
        return self.buf

    def is_last(self) -> bool:
        return self.last


def local_sgd_hook(r: int, rev: ProcessGroup) -> None:
    solo = ProcessGroup(rev.transport, [r], 10 + r, "solo", rev.timeout, rev.settings,
                        "loopback")
    for gradient_allreduce in (True, False):
        state = local_hook.PostLocalSGDState(process_group=rev, subgroup=solo,
                                             start_localSGD_iter=1,
                                             post_local_gradient_allreduce=gradient_allreduce)
        reduced = []
        for last in (False, True, True):  # one step of two buckets, then a local step
            bucket = _Bucket(r, last)
            local_hook.post_localSGD_hook(state=state, bucket=bucket).wait()  # type: ignore
            reduced.append(bucket.buf.tolist() == [1.5, 1.5])
        assert reduced == [True, True, False] and state.iter == 1
    state.maybe_increase_iter(bucket=_Bucket(r, True))  # type: ignore[arg-type]
    assert state.iter == 2


class _Optim:
    """Records what PostLocalSGDOptimizer hands to the optimizer it wraps."""

    def __init__(self, p: torch.nn.Parameter) -> None:
        self.param_groups: list[dict[str, Any]] = [{"params": [p], "lr": 0.5}]
        self.state: dict[Any, Any] = {}
        self.calls: list[Any] = []

    def step(self) -> None:
        self.calls.append("step")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.calls.append(("zero_grad", set_to_none))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.param_groups.append(param_group)

    def state_dict(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": [{"lr": 0.5, "params": [0]}]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.calls.append(("load", state_dict["param_groups"][0]["lr"]))


def local_sgd_optimizer(r: int, rev: ProcessGroup) -> None:
    p = _param(r)
    inner = _Optim(p)
    averager = averagers.PeriodicModelAverager(period=2, process_group=rev)
    opt = PostLocalSGDOptimizer(optim=inner, averager=averager)  # type: ignore[arg-type]
    assert isinstance(opt, torch.optim.Optimizer) and opt.state is inner.state
    opt.step()
    assert p.tolist() == [1.5, 1.5] and inner.calls == ["step"]
    opt.zero_grad(set_to_none=False)
    opt.add_param_group(param_group={"params": [], "lr": 1.0})
    assert inner.calls[-1] == ("zero_grad", False) and len(opt.param_groups) == 2
    assert opt.state_dict()["step"] == 1
    opt.load_state_dict(state_dict={"state": {}, "param_groups": [{"lr": 0.25}], "step": 7})
    assert inner.calls[-1] == ("load", 0.25) and opt.averager.step == 7


LOCAL_SGD_CHECKS: dict[str, Callable[[int, ProcessGroup], None]] = {
    "averagers": local_sgd_averagers, "utils": local_sgd_utils, "hook": local_sgd_hook,
    "optimizer": local_sgd_optimizer}


@pytest.mark.parametrize("name", sorted(LOCAL_SGD_CHECKS))
def test_post_local_sgd_names_behave_on_a_group_whose_ranks_are_reversed(name: str) -> None:
    def body(g: ProcessGroup) -> None:
        LOCAL_SGD_CHECKS[name](g.group_rank, _rev(g))

    run_threads(2, body, timeout=60, op_timeout=20)


# name -> parameter -> calls that must raise ArgumentError naming the parameter
LOCAL_SGD_REFUSED: dict[str, dict[str, list[Callable[[], Any]]]] = {
    "PeriodicModelAverager": {
        "period": [lambda: averagers.PeriodicModelAverager(period=0)],
        "warmup_steps": [lambda: averagers.PeriodicModelAverager(2, warmup_steps=-1)]},
    "HierarchicalModelAverager": {
        "period_group_size_dict": [lambda: HierarchicalModelAverager({}),
                                   lambda: HierarchicalModelAverager({0: 1})],
        "warmup_steps": [lambda: HierarchicalModelAverager({2: 1}, warmup_steps=-1)]},
    "PostLocalSGDState": {
        "start_localSGD_iter": [lambda: local_hook.PostLocalSGDState(None, None, -1)],
        "subgroup": [_in_job(lambda: local_hook.PostLocalSGDState(None, None, 0))],
        "post_local_gradient_allreduce": [
            lambda: local_hook.PostLocalSGDState(None, None, 0, "yes")]},  # type: ignore[arg-type]
    "get_params_to_average": {"params": [lambda: avg_utils.get_params_to_average([1.0])]},
    "average_parameters": {"params": [lambda: avg_utils.average_parameters([], None)]},
    "PostLocalSGDOptimizer": {
        "optim": [lambda: PostLocalSGDOptimizer(object(), object())],  # type: ignore[arg-type]
        "averager": [lambda: PostLocalSGDOptimizer(_Optim(_param(0)),  # type: ignore
                                                   object())]},  # type: ignore[arg-type]
}
_LOCAL_SGD_REFUSALS = [(f, p, i) for f, params in LOCAL_SGD_REFUSED.items()
                       for p, calls in params.items() for i in range(len(calls))]


@pytest.mark.parametrize("function,parameter,index", _LOCAL_SGD_REFUSALS,
                         ids=[f"{f}-{p}-{i}" for f, p, i in _LOCAL_SGD_REFUSALS])
def test_post_local_sgd_refusals_name_the_argument(secret: None, monkeypatch: pytest.MonkeyPatch,
                                                   function: str, parameter: str,
                                                   index: int) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ArgumentError, match=parameter):
        LOCAL_SGD_REFUSED[function][parameter][index]()


@pytest.mark.parametrize("name", sorted(LOCAL_SGD))
def test_every_post_local_sgd_parameter_is_audited(name: str) -> None:
    torch_params = [p for p in inspect.signature(LOCAL_SGD[name]).parameters
                    if p != "self" and not p.startswith("_")]
    sources = [inspect.getsource(fn) for fn in LOCAL_SGD_CHECKS.values()]
    shown = {p for p in torch_params if any(re.search(rf"\b{p}=", s) for s in sources)}
    unaccounted = set(torch_params) - shown - set(LOCAL_SGD_REFUSED.get(name.split(".")[0], {}))
    assert not unaccounted, (
        f"{name}: torch's parameters {sorted(unaccounted)} are neither shown honoured by a "
        f"behaviour check (passed by keyword) nor refused with a message")


def test_post_local_sgd_state_without_a_subgroup_groups_the_ranks_of_this_node(
        secret: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    _solo()
    state = local_hook.PostLocalSGDState(process_group=None, subgroup=None,
                                         start_localSGD_iter=0)
    assert isinstance(state.subgroup, ProcessGroup) and state.subgroup.ranks == [0]
    assert state.subgroup is not default_group()
    quiet = local_hook.PostLocalSGDState(None, None, 0, post_local_gradient_allreduce=False)
    assert quiet.subgroup is None  # never used: no group made
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    tandem.destroy_process_group()
    _solo()
    with pytest.raises(ArgumentError, match=r"PostLocalSGDState: subgroup=None .* pass subgroup"):
        local_hook.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=0)


def test_post_local_sgd_counts_may_be_numpy_integers(secret: None) -> None:
    numpy = pytest.importorskip("numpy")  # counts read from a config file often are
    _solo()
    periodic = averagers.PeriodicModelAverager(numpy.int64(3), numpy.int32(1))
    hier = HierarchicalModelAverager({numpy.int64(2): numpy.int64(1)}, numpy.int64(0))
    state = local_hook.PostLocalSGDState(None, default_group(), numpy.int16(4))
    assert (periodic.period, periodic.warmup_steps, hier._periods, state.start_localSGD_iter,
            ) == (3, 1, [2], 4)
    assert type(periodic.period) is int and type(state.start_localSGD_iter) is int


def test_averaging_at_every_step_warns_that_ddp_alone_costs_no_more(secret: None) -> None:
    _solo()
    with pytest.warns(UserWarning, match="period=1 .* DistributedDataParallel alone"):
        averagers.PeriodicModelAverager(period=1)
    with pytest.warns(UserWarning, match="largest period is 1"):
        HierarchicalModelAverager(period_group_size_dict={1: 1})
