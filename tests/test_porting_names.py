"""The rest of torch.distributed's namespace: every public name a script can reach is
either tandem's (and behaves as the script expects) or refused with what to use instead.

``test_every_torch_distributed_name_is_here_or_refused`` fails when torch adds a name,
until someone decides which it is.
"""

from __future__ import annotations

import datetime
import importlib
import types
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as tdist

import tandem
from tandem.collectives.group import NonMemberGroup, ProcessGroup
from tandem.collectives.porting import REFUSED
from tandem.collectives.world import default_group
from tandem.config import Settings
from tandem.errors import (ArgumentError, CollectiveMismatchError, CollectiveTimeoutError,
                           PeerLostError, ProtocolError, StateError, StoreError,
                           StoreTimeoutError, TandemError)
from tandem.transport.loopback import LoopbackHub

pytestmark = pytest.mark.timeout(60)

# what torch.distributed's module imports for itself, not API
NOT_API = {"log", "timedelta", "GroupName", "RankType"}


@pytest.fixture
def solo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TANDEM_SECRET", "porting-names-test")
    monkeypatch.delenv("TANDEM_TIMEOUT", raising=False)
    tandem.init_process_group("tcp", store=tandem.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if tandem.is_initialized():
            tandem.destroy_process_group()


def _torch_names() -> list[str]:
    with pytest.warns(FutureWarning):  # torch warns about its deprecated reduce_op on access
        names = [n for n in dir(tdist) if not n.startswith("_")
                 and not isinstance(getattr(tdist, n), types.ModuleType)]
    return sorted(set(names) - NOT_API)


def test_every_torch_distributed_name_is_here_or_refused() -> None:
    unaccounted = []
    for name in _torch_names():
        if name in tandem.__all__:
            assert hasattr(tandem, name)
            continue
        with pytest.raises(AttributeError) as info:
            getattr(tandem, name)
        if f"torch.distributed.{name}" not in str(info.value):
            unaccounted.append(name)
    assert not unaccounted, f"torch.distributed names tandem neither has nor refuses: {unaccounted}"
    assert not hasattr(tandem, "init_device_mesh")  # refused names stay absent for hasattr
    assert set(REFUSED).isdisjoint(tandem.__all__)


def test_a_refusal_says_what_to_use_instead() -> None:
    with pytest.raises(AttributeError, match="backend='tandem'"):
        tandem.init_device_mesh  # noqa: B018
    with pytest.raises(AttributeError, match="new_group"):
        tandem.split_group  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        tandem.no_such_name  # noqa: B018


# torch.distributed.<module>.<name> that tandem's twin module lacks: refused, saying why
SUBMODULE_REFUSALS = [
    ("tandem.optim", "apply_optimizer_in_backward", "hook_with_zero_step"),
    ("tandem.algorithms.ddp_comm_hooks", "quantization_hooks", "bf16_compress_hook"),
    ("tandem.algorithms.ddp_comm_hooks", "debugging_hooks", "bucket.buffer()"),
    ("tandem.algorithms.ddp_comm_hooks", "register_ddp_comm_hook", "register_comm_hook"),
    ("tandem.algorithms.ddp_comm_hooks", "DDPCommHookType", "register_comm_hook"),
    ("tandem.algorithms.ddp_comm_hooks.powerSGD_hook", "batched_powerSGD_hook",
     "powerSGD_hook"),
]


@pytest.mark.parametrize("module,name,hint", SUBMODULE_REFUSALS)
def test_a_submodule_name_tandem_lacks_is_refused_saying_what_to_use(
        module: str, name: str, hint: str) -> None:
    mod = importlib.import_module(module)
    with pytest.raises(AttributeError) as info:
        getattr(mod, name)
    assert isinstance(info.value, TandemError), info.value
    assert name in str(info.value) and hint in str(info.value), str(info.value)
    assert not hasattr(mod, name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        getattr(mod, "no_such_name")


def test_group_world_is_none_before_init_and_the_default_group_after(solo: None) -> None:
    g = default_group()
    assert tandem.group.WORLD is g and tandem.GroupMember.WORLD is g
    t = torch.tensor([3.0])
    tandem.all_reduce(t, group=tandem.group.WORLD)
    assert t.item() == 3.0 and tandem.get_world_size(group=tandem.group.WORLD) == 1
    assert tandem.get_pg_count() == 1
    tandem.new_group([0])
    assert tandem.get_pg_count() == 2
    tandem.destroy_process_group()
    assert tandem.group.WORLD is None and tdist.group.WORLD is None
    assert tandem.get_pg_count() == 0


def test_a_non_member_equals_torchs_non_group_member() -> None:
    outside = NonMemberGroup([0, 1], "pair", 2)
    assert outside == tandem.GroupMember.NON_GROUP_MEMBER == tdist.GroupMember.NON_GROUP_MEMBER
    assert not outside != tandem.GroupMember.NON_GROUP_MEMBER
    assert outside != NonMemberGroup([0, 1], "pair", 2) and outside == outside
    assert outside != -99 and outside != True  # noqa: E712 - a bool is not the sentinel
    assert len({outside, NonMemberGroup([0, 1], "pair", 2)}) == 2  # still hashable


def test_default_pg_timeout_is_what_a_group_gets(solo: None) -> None:
    assert tandem.default_pg_timeout == datetime.timedelta(seconds=Settings().timeout)
    assert tandem.default_pg_timeout == tdist.default_pg_timeout  # both 30 minutes
    assert default_group().timeout == tandem.default_pg_timeout.total_seconds()


@pytest.mark.parametrize("op", ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"])
def test_supports_complex_says_what_all_reduce_does(solo: None, op: str) -> None:
    reduce_op = getattr(tandem.ReduceOp, op)
    t = torch.tensor([1 + 2j, 3 - 1j])
    try:
        tandem.all_reduce(t, op=reduce_op)
        took = True
    except ArgumentError:
        took = False
    assert tandem.supports_complex(reduce_op) is took
    with pytest.raises(ArgumentError, match="ReduceOp"):
        tandem.supports_complex(op)


def test_backend_availability() -> None:
    assert tandem.is_gloo_available() and tandem.is_backend_available("gloo")
    for name in ("auto", "tcp", "shm", "cpu:gloo,cuda:nccl"):
        assert tandem.is_backend_available(name), name
    assert not tandem.is_nccl_available() and not tandem.is_backend_available("nccl")
    assert not any(f() for f in (tandem.is_mpi_available, tandem.is_ucc_available,
                                 tandem.is_xccl_available))
    assert not tandem.is_backend_available("carrier-pigeon")
    assert tandem.get_default_backend_for_device("cpu") == "auto"
    assert tandem.get_default_backend_for_device(torch.device("cpu")) == "auto"
    with pytest.raises(ArgumentError, match="CPU tensors only"):
        tandem.get_default_backend_for_device("cuda:0")


def test_launcher_questions(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TANDEM_RUN_ID", "TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not tandem.is_torchelastic_launched()
    monkeypatch.setenv("TANDEM_RUN_ID", "job7")
    assert tandem.is_torchelastic_launched()
    monkeypatch.delenv("TANDEM_RUN_ID")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job8")
    assert tandem.is_torchelastic_launched()
    with pytest.raises(RuntimeError, match="fallback_rank") as info:
        tandem.get_node_local_rank()
    assert isinstance(info.value, StateError)
    assert tandem.get_node_local_rank(fallback_rank=2) == 2
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert tandem.get_node_local_rank(fallback_rank=2) == 3
    monkeypatch.setenv("LOCAL_RANK", "three")
    with pytest.raises(ArgumentError, match="LOCAL_RANK"):
        tandem.get_node_local_rank()


def test_torchs_error_names_catch_tandems_errors() -> None:
    caught = {
        tandem.DistBackendError: [CollectiveTimeoutError("t"), CollectiveMismatchError("m"),
                                  PeerLostError("p", 1)],
        tandem.DistNetworkError: [PeerLostError("p", 1), ProtocolError("x")],
        tandem.DistStoreError: [StoreError("s"), StoreTimeoutError("w")],
    }
    for torch_name, errors in caught.items():
        for err in errors:
            assert isinstance(err, torch_name) and isinstance(err, tandem.DistError)
            assert isinstance(err, RuntimeError)
    assert not isinstance(ArgumentError("a"), tandem.DistError)  # bad input stays a ValueError
    assert issubclass(tandem.QueueEmptyError, tandem.DistStoreError)


def test_a_real_timeout_is_caught_as_a_dist_backend_error(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    hub = LoopbackHub(2)  # rank 1 never runs: rank 0's call times out
    lonely = ProcessGroup(hub.transports[0], [0, 1], 0, "lonely", 0.3, Settings(), "loopback")
    try:
        tandem.all_reduce(torch.ones(2), group=lonely)
    except tandem.DistBackendError as exc:  # what a ported `except dist.DistBackendError` does
        assert isinstance(exc, CollectiveTimeoutError)
    else:
        pytest.fail("the call did not time out")
    store = tandem.HashStore()
    store.set_timeout(datetime.timedelta(seconds=0.1))
    with pytest.raises(tandem.DistStoreError):
        store.get("never-set")


@pytest.mark.procs
def test_torchelastics_record_decorator_at_tandems_path(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Any) -> None:
    from tandem.elastic.multiprocessing.errors import record

    def main() -> None:
        raise ValueError("bad batch")

    for name in ("TORCHELASTIC_ERROR_FILE", "TANDEM_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert record(main) is main  # tandemrun's bootstrap records what escapes
    with pytest.raises(ArgumentError, match="error_handler"):
        record(main, error_handler=object())
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))  # as torchrun sets it
    with pytest.raises(ValueError):
        record(main)()
    assert "bad batch" in error_file.read_text()  # torch's decorator wrote torchrun's file
