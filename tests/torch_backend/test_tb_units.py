"""The torch backend's parts, in one process: registration, options, errors, store, work.

Run: ``python -m pytest tests/torch_backend/test_tb_units.py -q``.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tandem.torch_backend as tb
from tandem.collectives.checks import output_arg, plain_output
from tandem.collectives.reduce_op import ReduceOp, accepts, check_dtype
from tandem.collectives.work import Work
from tandem.errors import (ArgumentError, CollectiveMismatchError, CollectiveTimeoutError,
                           PeerLostError, StateError, StoreTimeoutError, TandemError)
from tandem.torch_backend._errors import TandemBackendError, translate
from tandem.torch_backend._fabric import Fabric, _group_id, group_timeout
from tandem.torch_backend._options import premultiplied, reduce_op
from tandem.torch_backend._store import TorchStore, master_address
from tandem.torch_backend._work import TorchWork
from tandem.config import Settings


def test_import_registers_the_backend_for_cpu_once() -> None:
    tb.register()  # again: harmless
    assert dist.Backend.backend_list.count("tandem") == 1
    assert dist.Backend.backend_capability["tandem"] == ["cpu"]
    assert dist.Backend.TANDEM == "tandem"
    assert getattr(dist.monitored_barrier, "tandem_routed", False)


def test_a_one_rank_job_runs_with_torchs_identity_calls() -> None:
    dist.init_process_group("tandem", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pg = dist.group.WORLD
        assert isinstance(pg, tb.TandemProcessGroup)
        assert dist.get_backend() == "tandem" and pg.name() == "tandem"
        assert pg.group_name == "0" and dist.get_backend_config() == "cpu:tandem"
        t = torch.arange(4.0)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        assert torch.equal(t, torch.arange(4.0))
        objects: list[Any] = [None]
        dist.all_gather_object(objects, {"a": 1})
        assert objects == [{"a": 1}]
        a, b = torch.ones(2), torch.ones(3)
        with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
            dist.all_reduce(a)  # torch's coalescing with a device: one handle for the calls
            dist.all_reduce(b)
        cm.wait()
        assert torch.equal(a, torch.ones(2)) and torch.equal(b, torch.ones(3))
    finally:
        dist.destroy_process_group()


def test_only_calls_torch_waits_on_at_once_return_no_handle() -> None:
    # torch's Python API skips the wait when a backend returns no handle; C++ callers
    # (DDP's reducer, functional collectives) pass asyncOp=True and always get one
    dist.init_process_group("tandem", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pg = dist.group.WORLD
        t = torch.arange(3.0)
        inline = dist.AllreduceOptions()
        inline.asyncOp = False
        assert pg.allreduce([t], inline) is None
        assert torch.equal(t, torch.arange(3.0))
        work = pg.allreduce([t])
        assert work is not None and work.wait()
        assert torch.equal(work.get_future().wait()[0], torch.arange(3.0))
        timed = dist.AllreduceOptions()
        timed.asyncOp = False
        timed.timeout = datetime.timedelta(seconds=30)
        assert pg.allreduce([t], timed) is not None  # its own timeout: waited with a deadline
        out = torch.empty(3)
        gather = dist.distributed_c10d.AllgatherOptions()
        gather.asyncOp = False
        assert pg.all_gather_single(out, t, gather) is None and torch.equal(out, t)
        scattered = pg.reduce_scatter_single(out, t * 2)
        assert scattered is not None and scattered.wait() and torch.equal(out, t * 2)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"])
def test_every_torch_reduce_op_maps_to_tandems(name: str) -> None:
    op, factor = reduce_op(getattr(dist.ReduceOp, name), "allreduce")
    assert op is getattr(ReduceOp, name) and factor is None
    options = dist.AllreduceOptions()
    options.reduceOp = getattr(dist.ReduceOp, name)
    assert reduce_op(options.reduceOp, "allreduce")[0] is getattr(ReduceOp, name)


def test_premul_sum_sums_after_multiplying_by_its_factor() -> None:
    for factor in (0.25, torch.tensor(0.25)):
        op, got = reduce_op(dist._make_nccl_premul_sum(factor), "allreduce")
        assert op is ReduceOp.SUM
        t = torch.tensor([4.0, 8.0])
        assert torch.equal(premultiplied(t, got, in_place=False), torch.tensor([1.0, 2.0]))
        assert torch.equal(t, torch.tensor([4.0, 8.0]))  # the input stays untouched
        assert premultiplied(t, got, in_place=True) is t and torch.equal(t, torch.tensor([1., 2.]))
    with pytest.raises(ArgumentError, match="one-element CPU tensor"):
        reduce_op(dist._make_nccl_premul_sum(torch.tensor(0.5, device="meta")), "allreduce")


def _plain_and_not() -> tuple[list[torch.Tensor], list[Any]]:
    plain = [torch.ones(3), torch.ones(2, 3, dtype=torch.int64), torch.ones((), dtype=torch.bool),
             torch.empty(0), torch.ones(4, 4)[1:3]]
    other = [torch.ones(3, 2).t(), torch.ones(1).expand(4), torch.ones(4, device="meta"),
             torch.sparse_coo_tensor([[0]], [1.0], (4,)),
             torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), [1.0], None]
    return plain, other


def test_a_plain_output_is_one_that_tandems_checks_accept() -> None:
    # the adapter skips tandem's own checks for plain outputs: a tensor taken for plain
    # that output_arg refuses would reach the engine unchecked
    plain, other = _plain_and_not()
    for t in plain:
        assert plain_output(t) and output_arg(t, "x", "t") is t
    for t in other:
        assert not plain_output(t), t


def _all_dtypes() -> list[torch.dtype]:
    return sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def test_accepts_agrees_with_check_dtype_for_every_builtin_op_and_dtype() -> None:
    ops = [getattr(ReduceOp, n) for n in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND",
                                          "BOR", "BXOR")]
    verdicts = []
    for op in ops:
        for dtype in _all_dtypes():
            try:
                check_dtype(op, dtype)
                passes = True
            except ArgumentError:
                passes = False
            assert accepts(op, dtype) == passes, (op, dtype)
            verdicts.append(passes)
    assert any(verdicts) and not all(verdicts)
    assert not accepts(ReduceOp.custom(torch.add), torch.float32)  # check_dtype decides


def test_allreduce_through_torch_keeps_tandems_argument_checks() -> None:
    dist.init_process_group("tandem", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pg = dist.group.WORLD
        inline = dist.AllreduceOptions()
        inline.asyncOp = False
        with pytest.raises(ArgumentError, match="overlap in memory"):
            pg.allreduce([torch.ones(1).expand(4)], inline)
        with pytest.raises(ArgumentError, match="only dense tensors"):
            pg.allreduce([torch.sparse_coo_tensor([[0]], [1.0], (4,))], inline)
        with pytest.raises(ArgumentError, match="AVG needs a floating"):
            dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.AVG)
        with pytest.raises(ArgumentError, match="AVG needs a floating"):
            dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.AVG,
                            async_op=True)
        strided = torch.arange(6.0).reshape(3, 2).t()  # not plain: takes tandem's checks
        dist.all_reduce(strided, op=dist.ReduceOp.MAX)
        assert torch.equal(strided, torch.arange(6.0).reshape(3, 2).t())
        work = dist.all_reduce(torch.ones(3), async_op=True)
        assert work is not None and work.wait()
    finally:
        dist.destroy_process_group()


def test_options_name_the_transports() -> None:
    assert tb.Options().transport == "auto"
    with pytest.raises(ArgumentError, match="'auto', 'shm' or 'tcp'"):
        tb.Options(transport="nccl")


def test_communication_failures_become_dist_backend_errors_naming_global_ranks() -> None:
    lost = translate(PeerLostError("rank 1 died", 1), lambda r: r + 10)
    assert isinstance(lost, TandemBackendError) and isinstance(lost, dist.DistBackendError)
    assert isinstance(lost, TandemError) and lost.rank == 11
    assert isinstance(lost.__cause__, PeerLostError) and "PeerLostError: rank 1 died" in str(lost)
    late = translate(CollectiveTimeoutError("late", (0, 2)))
    assert late.missing == (0, 2) and late.rank == -1  # type: ignore[attr-defined]
    assert isinstance(translate(CollectiveMismatchError("x")), dist.DistBackendError)
    assert isinstance(translate(StateError("aborted")), dist.DistBackendError)
    bad = ArgumentError("bad tensor")
    assert translate(bad) is bad  # a ValueError, as torch raises for bad arguments
    other = KeyError("k")
    assert translate(other) is other


def test_timeout_is_the_callers_or_tandems_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(timeout=42.0)
    default = dist.constants.default_pg_timeout
    assert group_timeout(datetime.timedelta(seconds=5), settings) == 5.0
    monkeypatch.delenv("TANDEM_TIMEOUT", raising=False)
    assert group_timeout(default, settings) == default.total_seconds()
    monkeypatch.setenv("TANDEM_TIMEOUT", "42")
    assert group_timeout(default, settings) == 42.0  # torch's default defers to tandem's knob


def test_group_ids_are_derived_from_names_and_collisions_are_refused() -> None:
    fabric = Fabric(transport=None, members=[0, 1], settings=Settings(),  # type: ignore[arg-type]
                    transport_name="auto")
    gid = _group_id("3", fabric)
    assert gid == _group_id("3", fabric) and 0 < gid < 2**31
    fabric.group_ids[gid] = "3"
    with pytest.raises(StateError, match="hash to the same tandem group id"):
        _group_id("3", fabric)


def test_torch_store_keeps_tandems_deadlines_and_errors() -> None:
    store = TorchStore(dist.HashStore(), timeout=0.3)
    store.set("k", b"\x00\xff")
    assert store.get("k") == b"\x00\xff" and store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("k", b"\x00\xff", b"v") == b"v" and store.check(["k"])
    assert store.delete_key("k") and not store.check(["k"])
    store.append("log", b"a\x00")
    store.append("log", "b")
    assert store.get("log") == b"a\x00b"
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="'missing'"):
        store.get("missing")
    assert time.monotonic() - start < 3.0


def test_master_address_is_found_under_prefix_stores() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    nested = dist.PrefixStore("a/", dist.PrefixStore("b/", server))
    assert master_address(nested) == "127.0.0.1"
    assert master_address(dist.HashStore()) is None


def _done(result: Any = None, error: BaseException | None = None) -> Work:
    work = Work("op", result)
    work._complete(error=error)
    return work


def test_work_hands_torch_results_and_translated_errors() -> None:
    t = torch.ones(2)
    ok = TorchWork([_done([t])], [t])
    assert ok.wait() and ok.is_completed() and ok.is_success() and ok.result() == [t]
    assert ok.get_future().wait()[0] is t
    failed = TorchWork([_done(error=PeerLostError("rank 1 died", 1))], [t])
    with pytest.raises(TandemBackendError, match="rank 1 died"):
        failed.wait()
    assert isinstance(failed.exception(), dist.DistBackendError)
    with pytest.raises(RuntimeError, match="TandemBackendError: PeerLostError"):
        failed.get_future().wait()
    finished = TorchWork((), [t])  # a call that ran inline
    assert finished.wait() and finished.get_future().value() == [t]


def test_work_enforces_the_calls_own_timeout() -> None:
    expired: list[str] = []

    def expire() -> BaseException:
        expired.append("aborted")
        return CollectiveTimeoutError("did not complete within its timeout")

    pending = TorchWork([Work("op")], None, deadline=time.monotonic() + 0.2, expire=expire)
    with pytest.raises(TandemBackendError, match="within its timeout"):
        pending.wait()
    assert expired == ["aborted"]
    waiting = TorchWork([Work("op")], None)  # no call timeout: only this wait's ends
    with pytest.raises(TandemBackendError, match="did not complete within 0.1s"):
        waiting.wait(datetime.timedelta(seconds=0.1))
