"""rpc_sync, rpc_async and remote between two worker processes: values, futures, errors.

One job of two workers runs every case (processes cost seconds, checks cost nothing);
each test checks one behaviour in its results. Worker 0 calls, worker 1 serves.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem.rpc as rpc
from tandem.errors import StateError
from _rpc_workers import (Batcher, Counter, LOG, add, add_later, attempt, boom, echo,
                          ping_pong, run, sleep_then, whoami)

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]


def _tensors() -> dict[str, torch.Tensor]:
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    return {"f64": base, "f32": base.float(), "f16": base.half(), "bf16": base.bfloat16(),
            "i64": base.long(), "i8": base.to(torch.int8), "u8": base.to(torch.uint8),
            "bool": base > 10, "c64": torch.complex(base.float(), -base.float()),
            "scalar": torch.tensor(3.5), "empty": torch.empty(0, 3),
            "strided": base.t()[1:3], "big": torch.arange(3 << 20, dtype=torch.float32)}


def _caller(rank: int, world: int) -> dict[str, Any]:
    r: dict[str, Any] = {}
    if rank == 1:
        rpc.shutdown()  # serves until worker 0 has no more calls outstanding
        return {"log": list(LOG)}
    r["by_name"] = rpc.rpc_sync("worker1", whoami)
    r["by_rank"] = rpc.rpc_sync(1, whoami)
    r["by_info"] = rpc.rpc_sync(rpc.get_worker_info("worker1"), whoami)
    r["kwargs"] = rpc.rpc_sync("worker1", add, kwargs={"a": 2, "b": 40})
    r["rpc_timeout"] = rpc.get_rpc_timeout()
    r["info"] = (rpc.get_worker_info().name, rpc.get_worker_info().id,
                 rpc.get_worker_info("worker1").id)
    sent = _tensors()
    back = rpc.rpc_sync("worker1", echo, args=(sent,))
    r["tensors"] = {k: (v.dtype == sent[k].dtype, v.shape == sent[k].shape,
                        bool(torch.equal(v, sent[k].contiguous())),
                        v.data_ptr() != sent[k].data_ptr() or v.numel() == 0)
                    for k, v in back.items()}
    grad = torch.ones(3, requires_grad=True)
    got = rpc.rpc_sync("worker1", echo, args=(grad,))
    r["requires_grad"] = (got.requires_grad, got.is_leaf)
    r["parameter"] = type(rpc.rpc_sync("worker1", echo, args=(torch.nn.Parameter(torch.ones(2)),)))
    same = torch.ones(2)
    pair = rpc.rpc_sync("worker1", echo, args=((same, same),))
    r["shared_object"] = pair[0] is pair[1]
    fut = rpc.rpc_async("worker1", add, args=(torch.ones(2), 1))
    r["future_type"] = isinstance(fut, torch.futures.Future)
    r["then"] = fut.then(lambda f: f.value().sum().item()).wait()
    done = threading.Event()
    rpc.rpc_async("worker1", echo, args=(1,)).add_done_callback(lambda f: done.set())
    r["done_callback"] = done.wait(10)
    futs = [rpc.rpc_async("worker1", add, args=(i, i)) for i in range(50)]
    r["wait_all"] = torch.futures.wait_all(futs)
    r["self_call"] = rpc.rpc_sync("worker0", whoami)
    mine = torch.zeros(3)
    copy = rpc.rpc_sync("worker0", echo, args=(mine,))
    r["self_copy"] = copy.data_ptr() != mine.data_ptr()
    r["remote_error"] = attempt(rpc.rpc_sync, "worker1", boom, args=("bad thing 17",))
    r["async_error"] = attempt(lambda: rpc.rpc_async("worker1", boom, args=("later",)).wait())
    r["unknown"] = attempt(rpc.rpc_sync, "worker9", echo, args=(1,))
    r["bad_rank"] = attempt(rpc.rpc_sync, 5, echo, args=(1,))
    r["nan_timeout"] = attempt(rpc.rpc_sync, "worker1", echo, args=(1,), timeout=float("nan"))
    r["lambda"] = attempt(rpc.rpc_sync, "worker1", lambda x: x, args=(1,))

    def local(x: Any) -> Any:
        return x
    r["closure"] = attempt(rpc.rpc_sync, "worker1", local, args=(1,))
    r["unpicklable"] = attempt(rpc.rpc_sync, "worker1", echo, args=(threading.Lock(),))
    r["ping_pong"] = rpc.rpc_sync("worker1", ping_pong, args=(4, "worker1", "worker0"))
    batcher = rpc.remote("worker1", Batcher, args=(3,))
    futs = [batcher.rpc_async().submit(i) for i in (1, 2, 3)]
    r["async_execution"] = [f.wait() for f in futs]
    r["async_chain"] = rpc.rpc_sync("worker1", add_later, args=(torch.ones(2),)).tolist()
    counter = rpc.remote("worker1", Counter, args=(10,))
    r["proxy_sync"] = counter.rpc_sync().add(5)
    r["proxy_async"] = counter.rpc_async().add(1).wait()
    r["proxy_remote"] = counter.remote().get().to_here()
    r["to_here"] = rpc.remote("worker1", add, args=(torch.ones(2), 2)).to_here().tolist()
    r["remote_error_at_use"] = attempt(rpc.remote("worker1", boom, args=("made late",)).to_here)
    r["remote_to_self"] = rpc.remote("worker0", add, args=(1, 2)).to_here()
    r["owner"] = (counter.owner().name, counter.owner_name(), counter.is_owner())
    # left running: graceful shutdown must wait for it on both workers
    rpc.rpc_async("worker1", sleep_then, args=(1.0,))
    rpc.shutdown()
    r["after_shutdown"] = attempt(rpc.rpc_sync, "worker1", echo, args=(1,))
    r["timeout_after_shutdown"] = attempt(rpc.get_rpc_timeout)
    return r


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run(2, _caller, tmp_path_factory.mktemp("calls"), num_worker_threads=1,
               rpc_timeout=45)


@pytest.mark.smoke("tandem.rpc")
def test_to_accepts_a_name_a_rank_or_a_worker_info(results: list[dict[str, Any]]) -> None:
    r = results[0]
    assert (r["by_name"], r["by_rank"], r["by_info"]) == ("worker1",) * 3
    assert r["kwargs"] == 42
    assert r["info"] == ("worker0", 0, 1)


def test_tensors_of_every_dtype_and_layout_arrive_equal_and_as_copies(
        results: list[dict[str, Any]]) -> None:
    for name, (dtype, shape, equal, copy) in results[0]["tensors"].items():
        assert dtype and shape and equal and copy, f"{name}: dtype {dtype} shape {shape} " \
                                                   f"equal {equal} copy {copy}"


def test_requires_grad_and_parameters_survive_the_trip(results: list[dict[str, Any]]) -> None:
    assert results[0]["requires_grad"] == (True, True)
    assert results[0]["parameter"] is torch.nn.Parameter
    assert results[0]["shared_object"], "one tensor passed twice must arrive as one object"


def test_rpc_async_returns_a_torch_future(results: list[dict[str, Any]]) -> None:
    r = results[0]
    assert r["future_type"]
    assert r["then"] == 4.0
    assert r["done_callback"]
    assert r["wait_all"] == [2 * i for i in range(50)]


def test_a_worker_can_call_itself_and_gets_copies(results: list[dict[str, Any]]) -> None:
    assert results[0]["self_call"] == "worker0"
    assert results[0]["self_copy"]
    assert results[0]["remote_to_self"] == 3


def test_remote_exception_keeps_its_type_and_names_the_worker(
        results: list[dict[str, Any]]) -> None:
    err = results[0]["remote_error"]
    assert err["type"] == "ValueError", err
    assert "worker 'worker1'" in err["msg"] and "bad thing 17" in err["msg"], err["msg"]
    assert "Traceback" in err["msg"] and "in boom" in err["msg"], err["msg"]
    assert results[0]["async_error"]["type"] == "ValueError"


def test_unknown_worker_lists_the_known_names(results: list[dict[str, Any]]) -> None:
    err = results[0]["unknown"]
    assert err["type"] == "ArgumentError"
    assert "'worker9'" in err["msg"] and "'worker0', 'worker1'" in err["msg"], err["msg"]
    assert "out of range" in results[0]["bad_rank"]["msg"]


def test_a_timeout_that_is_not_a_number_of_seconds_is_refused(results: list[dict[str, Any]]
                                                              ) -> None:
    err = results[0]["nan_timeout"]
    assert err["type"] == "ArgumentError" and "timeout" in err["msg"], err


def test_lambdas_and_closures_are_refused_with_a_message(results: list[dict[str, Any]]) -> None:
    for case in ("lambda", "closure"):
        err = results[0][case]
        assert err["type"] == "ArgumentError", err
        assert "module level" in err["msg"], err["msg"]
    assert results[0]["unpicklable"]["type"] == "ArgumentError"
    assert "lock" in results[0]["unpicklable"]["msg"].lower()


def test_nested_ping_pong_depth_4_with_one_server_thread(results: list[dict[str, Any]]) -> None:
    assert results[0]["ping_pong"] == ["worker1", "worker0"] * 2 + ["worker1"]


def test_async_execution_replies_when_the_future_completes(
        results: list[dict[str, Any]]) -> None:
    # three calls wait in one server thread's Batcher until the third arrives
    assert results[0]["async_execution"] == [6, 6, 6]
    assert results[0]["async_chain"] == [2.0, 2.0]


def test_remote_and_rref_proxies(results: list[dict[str, Any]]) -> None:
    r = results[0]
    assert (r["proxy_sync"], r["proxy_async"], r["proxy_remote"]) == (15, 16, 16)
    assert r["to_here"] == [3.0, 3.0]
    assert r["owner"] == ("worker1", "worker1", False)
    err = r["remote_error_at_use"]
    assert err["type"] == "ValueError" and "made late" in err["msg"], err


def test_graceful_shutdown_waits_for_outstanding_work(results: list[dict[str, Any]]) -> None:
    assert results[1]["log"] == ["slept 1.0"]


def test_rpc_after_shutdown_is_a_clear_error(results: list[dict[str, Any]]) -> None:
    err = results[0]["after_shutdown"]
    assert err["type"] == "StateError" and "init_rpc" in err["msg"], err


def test_get_rpc_timeout_is_the_one_given_to_init_rpc(results: list[dict[str, Any]]) -> None:
    assert results[0]["rpc_timeout"] == 45.0 and type(results[0]["rpc_timeout"]) is float
    err = results[0]["timeout_after_shutdown"]
    assert err["type"] == "StateError" and "get_rpc_timeout" in err["msg"], err
    assert rpc.constants.DEFAULT_RPC_TIMEOUT_SEC == 60.0  # torch's default, in seconds
    assert rpc.constants.UNSET_RPC_TIMEOUT == -1.0  # the calls' default timeout argument


def test_rpc_before_init_is_a_clear_error() -> None:
    with pytest.raises(StateError, match="init_rpc"):
        rpc.rpc_sync("worker1", echo, args=(1,))
