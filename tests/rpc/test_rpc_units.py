"""The RPC pieces that need no second process: options, names, the codec, the pool, and
the public surface compared with torch's (porting is a changed import)."""

from __future__ import annotations

import inspect
import threading
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.autograd as torch_autograd
import torch.distributed.rpc as torch_rpc

import tandem.autograd
import tandem.nn
import tandem.optim
import tandem.rpc as rpc
from tandem.errors import ArgumentError, RpcError, StateError
from tandem.nn.remote_module import parse_remote_device
from tandem.rpc import _codec
from tandem.rpc._calls import rebuild_error, remote_error_fields
from tandem.rpc._pool import ServerPool
from tandem.rpc.worker import Directory, WorkerInfo

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("name", ["init_rpc", "shutdown", "get_worker_info", "rpc_sync",
                                  "rpc_async", "remote"])
def test_rpc_functions_take_torchs_parameters(name: str) -> None:
    theirs = list(inspect.signature(getattr(torch_rpc, name)).parameters)
    ours = list(inspect.signature(getattr(rpc, name)).parameters)
    assert ours[:len(theirs)] == theirs, f"{name}: {ours} vs torch's {theirs}"


def test_rref_and_friends_have_torchs_public_methods() -> None:
    public = {m for m in dir(torch_rpc.RRef) if not m.startswith("_")}
    assert public <= set(dir(rpc.RRef)), public - set(dir(rpc.RRef))
    for name in ("context", "backward", "get_gradients", "is_available"):
        assert hasattr(torch_autograd, name) and hasattr(tandem.autograd, name), name
    with warnings.catch_warnings():  # torch scripts its functional optimizers on import
        warnings.simplefilter("ignore", DeprecationWarning)
        import torch.distributed.nn as torch_nn
        import torch.distributed.optim as torch_optim
    theirs = list(inspect.signature(torch_optim.DistributedOptimizer.__init__).parameters)
    assert list(inspect.signature(tandem.optim.DistributedOptimizer.__init__).parameters) == theirs
    theirs = list(inspect.signature(torch_nn.RemoteModule.__init__).parameters)
    ours = list(inspect.signature(tandem.nn.RemoteModule.__init__).parameters)
    assert ours[:len(theirs)] == theirs
    for name in ("forward", "forward_async", "remote_parameters", "get_module_rref",
                 "init_from_module_rref"):
        assert hasattr(tandem.nn.RemoteModule, name), name
    fields = inspect.signature(torch_rpc.TensorPipeRpcBackendOptions.__init__).parameters
    ours_fields = inspect.signature(rpc.TensorPipeRpcBackendOptions.__init__).parameters
    assert set(fields) <= set(ours_fields)


def test_options_honour_the_cpu_and_refuse_accelerators() -> None:
    opts = rpc.TensorPipeRpcBackendOptions(devices=["cpu"], device_maps={"w1": {"cpu": "cpu"}})
    assert opts.devices == [torch.device("cpu")]
    with pytest.raises(ArgumentError, match="CPU tensors only"):
        rpc.TensorPipeRpcBackendOptions(devices=["cuda:0"])
    with pytest.raises(ArgumentError, match="CPU tensors only"):
        rpc.TensorPipeRpcBackendOptions(device_maps={"w1": {0: 1}})
    with pytest.raises(ArgumentError, match="CPU tensors only"):
        opts.set_device_map("w1", {"cpu": "cuda:1"})
    opts.set_devices(["cpu", torch.device("cpu")])
    assert opts.devices == [torch.device("cpu")] * 2
    with pytest.raises(ArgumentError, match="CPU tensors only"):
        opts.set_devices(["cuda:0"])
    with pytest.raises(ArgumentError, match="must be a list"):
        opts.set_devices("cpu")
    methods = {m for m in dir(torch_rpc.TensorPipeRpcBackendOptions) if not m.startswith("_")
               and callable(getattr(torch_rpc.TensorPipeRpcBackendOptions, m))}
    assert methods <= set(dir(rpc.TensorPipeRpcBackendOptions)), methods


@pytest.mark.parametrize("kwargs, message", [
    ({"num_worker_threads": 0}, "num_worker_threads"),
    ({"rpc_timeout": -1}, "rpc_timeout"),
    ({"rpc_timeout": float("nan")}, "rpc_timeout"),
    ({"init_method": "localhost:29500"}, "init_method"),
    ({"_transports": ["ibv"]}, "'uv'"),
    ({"_channels": ["cma"]}, "_channels"),
])
def test_options_refuse_what_tandem_cannot_do(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ArgumentError, match=message):
        rpc.TensorPipeRpcBackendOptions(**kwargs)


def test_transports_choose_the_wire() -> None:
    from tandem.rpc.options import transport_backend

    assert transport_backend(None) == "auto"
    assert transport_backend(["uv"]) == "tcp"
    assert transport_backend(["shm"]) == "shm"
    assert transport_backend(["uv", "shm"]) == "auto"


def test_init_rpc_refuses_bad_names_and_backends_before_any_rendezvous() -> None:
    with pytest.raises(ArgumentError, match="worker name"):
        rpc.init_rpc("has/slash", rank=0, world_size=1)
    with pytest.raises(ArgumentError, match="TENSORPIPE"):
        rpc.init_rpc("w0", backend="gloo", rank=0, world_size=1)  # type: ignore[arg-type]


@pytest.mark.procs
def test_a_forked_child_does_not_inherit_the_agent() -> None:
    import os

    from tandem.rpc import _state

    class Fake:
        closed = False

    fake = Fake()
    _state._agent = fake  # type: ignore[assignment]
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if _state.current() is None and fake.closed else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child still saw the agent"
    finally:
        _state._agent = None


def test_api_before_init_says_to_call_init_rpc() -> None:
    for call in (lambda: rpc.get_worker_info(), lambda: rpc.RRef(1),
                 lambda: rpc.remote("w1", len, args=("ab",)), lambda: rpc.shutdown(),
                 lambda: tandem.autograd.context().__enter__()):
        with pytest.raises(StateError, match="init_rpc"):
            call()


def test_directory_resolves_names_ranks_and_infos() -> None:
    d = Directory(["ps", "trainer0", "trainer1"], 1)
    assert d.rank_of("trainer1") == 2 and d.rank_of(0) == 0
    assert d.rank_of(WorkerInfo("ps", 0)) == 0
    with pytest.raises(ArgumentError, match="'ps', 'trainer0', 'trainer1'"):
        d.rank_of("trainer7")
    with pytest.raises(ArgumentError, match="not a worker of this job"):
        d.rank_of(WorkerInfo("ps", 2))
    with pytest.raises(ArgumentError, match="both called init_rpc with the name 'ps'"):
        Directory(["ps", "ps"], 0)
    assert repr(WorkerInfo("ps", 0)) == "WorkerInfo(id=0, name=ps)"
    assert len({WorkerInfo("ps", 0), WorkerInfo("ps", 0)}) == 1


def test_an_unknown_worker_error_lists_a_few_workers_of_a_large_job() -> None:
    # it named every one of 100,000 workers
    d = Directory([f"w{i}" for i in range(100_000)], 0)
    with pytest.raises(ArgumentError) as info:
        d.rank_of("nobody")
    assert "'w0', 'w1'" in str(info.value) and "and 99984 more" in str(info.value)
    assert len(str(info.value)) < 500


def _roundtrip(obj: Any) -> tuple[Any, _codec.Outgoing]:
    out = _codec.encode(obj, "a test message")
    from tandem.transport.base import Header, Kind

    header = Header(Kind.RPC, out.meta_bytes, 1, 0, out.nbytes)
    message = _codec.read_message(header, _codec.local_reader(out.parts), "me")
    return _codec.decode(message), out


def test_tensors_travel_beside_the_pickle_not_inside_it() -> None:
    big = torch.arange(1 << 20, dtype=torch.float32)
    back, out = _roundtrip({"x": big, "n": 3})
    assert torch.equal(back["x"], big) and back["n"] == 3
    assert out.meta_bytes < 512, f"{out.meta_bytes}-byte table and pickle for a 4 MB tensor"
    assert out.parts[2].obj is not None  # a view of the tensor's memory, not a copy
    assert out.nbytes == out.meta_bytes + big.nbytes


def test_a_truncated_or_inflated_table_is_a_protocol_error() -> None:
    from tandem.errors import ProtocolError
    from tandem.transport.base import Header, Kind

    out = _codec.encode(torch.ones(4), "x")
    bad = Header(Kind.RPC, out.meta_bytes, 1, 0, out.nbytes + 8)
    wire = out.parts + [memoryview(bytes(8))]  # the frame does carry the bytes it announces
    with pytest.raises(ProtocolError, match="add up"):
        _codec.read_message(bad, _codec.local_reader(wire), "worker 'w1' (rank 1)")


def test_lambdas_and_accelerator_tensors_are_refused() -> None:
    with pytest.raises(ArgumentError, match="module level"):
        _codec.encode((lambda: 1,), "a call")
    with pytest.raises(ArgumentError, match="cannot send"):
        _codec.encode((threading.Lock(),), "a call")


def test_remote_exceptions_are_rebuilt_with_their_class_when_possible() -> None:
    try:
        raise KeyError("missing key")
    except KeyError as exc:
        fields = remote_error_fields(exc, "'w1' (rank 1)")
    error = rebuild_error(*fields)
    assert isinstance(error, KeyError) and "On worker 'w1' (rank 1)" in error.args[0]
    assert "missing key" in error.args[0] and "Traceback" in error.args[0]

    class Odd(Exception):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(a, b)

    error = rebuild_error(*remote_error_fields(Odd(1, 2), "'w1' (rank 1)"))
    assert isinstance(error, RpcError) and "Odd" in str(error)


def test_a_blocked_pool_thread_lets_another_run_queued_work() -> None:
    pool = ServerPool(1, "test-pool", max_threads=4, max_queued=16)
    inner_ran = threading.Event()
    outer_done = threading.Event()

    def inner() -> None:
        inner_ran.set()

    def outer() -> None:
        pool.submit(inner)
        with pool.blocked():  # as a served call waiting on a nested RPC
            inner_ran.wait(5)
        outer_done.set()

    try:
        pool.submit(outer)
        assert outer_done.wait(5), "one-thread pool starved: nested work never ran"
    finally:
        assert pool.close(2.0) == []


def test_remote_devices_name_a_worker_and_the_cpu() -> None:
    assert parse_remote_device("worker1/cpu") == ("worker1", "cpu")
    assert parse_remote_device("rank:1/cpu") == (1, "cpu")
    assert parse_remote_device("ps") == ("ps", "cpu")
    with pytest.raises(ArgumentError, match="CPU tensors only"):
        parse_remote_device("worker1/cuda:0")
    for bad in ("a/b/c", "rank:x/cpu", "/cpu", ""):
        with pytest.raises(ArgumentError):
            parse_remote_device(bad)


def test_one_large_pickle_does_not_slow_every_later_message() -> None:
    # a pickler's memo keeps the size of the largest structure it pickled, and clearing
    # it walks all of it: the thread's pickler is replaced after a large pickle instead
    _codec.encode((test_directory_resolves_names_ranks_and_infos, (torch.ones(2),), None), "x")
    small = _codec._cache.pickler
    assert small is not None
    _codec.encode([(str(i), i * 1.5) for i in range(5000)], "a large structure")
    assert _codec._cache.pickler is None
    _codec.encode((1, 2), "x")
    assert _codec._cache.pickler is not None and _codec._cache.pickler is not small
    assert not _codec._cache.pickler.memo.copy()  # nothing of either message is kept


def _form(out: _codec.Outgoing) -> int:
    """The message-level flags an encoded message carries (its short form, if any)."""
    return _codec._HEAD.unpack_from(bytes(out.parts[0]))[3]


def _decode_wire(out: _codec.Outgoing) -> Any:
    from tandem.transport.base import Header, Kind

    header = Header(Kind.RPC, out.meta_bytes, 1, 0, out.nbytes)
    return _codec.decode(_codec.read_message(header, _codec.local_reader(out.parts), "me"))


def _same_tensor(a: Any, b: torch.Tensor) -> bool:
    return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
            and a.requires_grad == b.requires_grad and torch.equal(a.detach(), b.detach()))


def test_a_call_of_tensors_only_travels_without_a_structure_and_decodes_alike() -> None:
    w = torch.nn.Parameter(torch.randn(3, 2))
    big = torch.arange(1 << 16, dtype=torch.float64)  # 512 KB: sent as a view of its memory
    args_sets = [(torch.ones(16),), (torch.arange(6).reshape(2, 3).t(), torch.tensor(2.5)),
                 (torch.randn(4, requires_grad=True), w), (big, torch.zeros(0, 3)),
                 (torch.randn(3, dtype=torch.complex64).conj(),)]
    for args in args_sets:
        out = _codec.encode_call(torch.add, args, None, "a call")
        assert _form(out) == _codec._ARGS, [tuple(a.shape) for a in args]
        plain = _decode_wire(_codec.encode((torch.add, args, None), "a call"))
        func, got, kwargs = _decode_wire(out)
        assert func is torch.add is plain[0] and kwargs is None is plain[2]
        assert type(got) is tuple and len(got) == len(args) == len(plain[1])
        for mine, theirs, sent in zip(got, plain[1], args):
            assert _same_tensor(mine, sent) and _same_tensor(theirs, sent)
            assert not sent.numel() or mine.data_ptr() != sent.data_ptr()  # a copy


def test_calls_that_are_not_only_tensors_keep_the_pickled_structure() -> None:
    x = torch.ones(3)
    bound = x.add
    # one tensor twice (both arguments stay one object), a non-tensor, keywords, nesting...
    calls: list[tuple[Any, tuple[Any, ...], Any]] = [
             (torch.add, (x, x), None), (torch.add, (x, 1), None), (torch.add, (x,), {"alpha": 2}),
             (torch.cat, ([x, {"y": x * 2}],), None), (test_form_of_a_result_tensor, (), None),
             (bound, (x * 3,), None)]  # a builtin bound to a tensor carries that tensor
    for func, args, kwargs in calls:
        out = _codec.encode_call(func, args, kwargs, "a call")
        assert _form(out) & _codec._FORMS == 0, (func, args, kwargs)
        got_func, got_args, got_kwargs = _decode_wire(out)
        assert got_kwargs == kwargs
        if func is bound:
            assert torch.equal(got_func(*got_args), func(*args))
        else:
            assert got_func is func
        assert repr(got_args) == repr(args)
    got = _decode_wire(_codec.encode_call(torch.add, (x, x), None, "a call"))[1]
    assert got[0] is got[1]
    with pytest.raises(ArgumentError, match="module level"):
        _codec.encode_call(lambda t: t, (x,), None, "a call")


def test_form_of_a_result_tensor() -> None:
    x = torch.randn(5, 4)
    for value in (x, x.t(), torch.tensor(3), torch.nn.Parameter(x), x.requires_grad_(False),
                  torch.zeros(0), torch.arange(1 << 15, dtype=torch.int64)):
        out = _codec.encode(value, "the result")
        assert _form(out) == _codec._BARE
        assert _same_tensor(_decode_wire(out), value)
    sparse = torch.eye(3).to_sparse()  # torch pickles it: no short form
    out = _codec.encode(sparse, "the result")
    assert _form(out) == 0 and torch.equal(_decode_wire(out).to_dense(), torch.eye(3))


def test_a_short_form_that_contradicts_its_table_is_a_protocol_error() -> None:
    from tandem.errors import ProtocolError
    from tandem.transport.base import Header, Kind

    def forged(flags: int, obj: Any) -> bytes:
        wire = bytearray(b"".join(bytes(p) for p in _codec.encode(obj, "x").parts))
        wire[_codec._HEAD.size - 1] = flags
        return bytes(wire)

    x = torch.ones(2)
    for flags, obj in [(_codec._BARE, (x, x * 2)), (_codec._BARE, [x]),
                       (_codec._ARGS, (1, 2)), (_codec._BARE | _codec._ARGS, x),
                       (_codec._ARGS | _codec._RREFS, x), (0x40, x)]:
        wire = forged(flags, obj)
        out = _codec.encode(obj, "x")
        header = Header(Kind.RPC, out.meta_bytes, 1, 0, len(wire))
        with pytest.raises(ProtocolError):
            _codec.read_message(header, _codec.local_reader([memoryview(wire)]), "w1")


def test_a_remembered_function_name_never_stands_for_an_object_bound_to_it() -> None:
    # module-level and builtin functions are pickled once and remembered; a builtin bound
    # to an object carries that object, whose state may change between calls
    x = torch.ones(2)
    items = [1]
    for _ in range(2):
        assert _decode_wire(_codec.encode_call(torch.neg, (x,), None, "a call"))[0] is torch.neg
    assert _codec._NAMES.get(torch.neg) is not None
    first = _decode_wire(_codec.encode_call(items.copy, (x,), None, "a call"))[0]
    items.append(2)
    second = _decode_wire(_codec.encode_call(items.copy, (x,), None, "a call"))[0]
    assert first() == [1] and second() == [1, 2]


def test_an_autograd_context_rides_on_every_form_with_the_tensors_that_need_grad() -> None:
    from tandem.transport.base import Header, Kind

    w = torch.randn(3, requires_grad=True)
    plain = torch.ones(2)
    encoded = {"args": _codec.encode_call(torch.mul, (w, plain), None, "a call", None, 7,
                                          lambda ts: 41 if ts == [w] else -1),
               "bare": _codec.encode(w, "the result", None, 7, lambda ts: 42 if ts == [w] else -1),
               "pickled": _codec.encode({"w": w, "n": 1}, "x", None, 7,
                                        lambda ts: 43 if ts == [w] else -1)}
    for name, out in encoded.items():
        header = Header(Kind.RPC, out.meta_bytes, 1, 0, out.nbytes)
        message = _codec.read_message(header, _codec.local_reader(out.parts), "me")
        assert message.ctx_id == 7 and message.amsg == {"args": 41, "bare": 42,
                                                        "pickled": 43}[name], name
        assert len(message.grads) == 1 and message.grads[0].requires_grad, name
        assert torch.equal(message.grads[0].detach(), w.detach()), name


class _FakeRRef:
    """Stands for tandem's RRef in the codec: reduced through the fork callback."""

    _tandem_rref = True

    def __init__(self, n: int) -> None:
        self.n = n

    def __reduce__(self) -> Any:  # as tandem's RRef: never pickled outside RPC
        raise StateError("an RRef cannot be pickled")


def test_rrefs_in_a_call_go_through_the_fork_callback_and_come_back_built() -> None:
    from tandem.transport.base import Header, Kind

    forked: list[int] = []

    def fork(rref: Any) -> tuple[Any, ...]:
        forked.append(rref.n)
        return (1, (1, rref.n), (0, 100 + rref.n), 0)

    a, b = _FakeRRef(5), _FakeRRef(6)
    x = torch.ones(2)
    out = _codec.encode_call(torch.add, (a, x), {"other": [b]}, "a call", fork)
    assert forked == [5, 6] and [f for _, f in out.rrefs] == [(0, 105), (0, 106)]
    assert _form(out) == _codec._RREFS  # an RRef argument keeps the pickled structure
    header = Header(Kind.RPC, out.meta_bytes, 1, 0, out.nbytes)
    message = _codec.read_message(header, _codec.local_reader(out.parts), "me")
    built = _codec.decode(message, lambda *fields: ("rref", fields))
    assert built[0] is torch.add and built[1][0] == ("rref", (1, (1, 5), (0, 105), 0))
    assert torch.equal(built[1][1], x) and built[2] == {"other": [("rref", (1, (1, 6),
                                                                            (0, 106), 0))]}
    with pytest.raises(ArgumentError, match="cannot be pickled"):  # no fork: not via RPC
        _codec.encode(_FakeRRef(1), "x")


@pytest.mark.parametrize("rank, world_size", [(-5, 1), ("0", 1), (1.5, 2), (True, 1), (0, 0),
                                              (0, "1")])
def test_init_rpc_refuses_a_rank_or_world_size_of_the_wrong_kind_before_any_rendezvous(
        rank: Any, world_size: Any) -> None:
    # rank="0" failed with a TypeError from a comparison inside the rendezvous
    with pytest.raises(ArgumentError, match="init_rpc: (rank|world_size) must be an int"):
        rpc.init_rpc("w0", rank=rank, world_size=world_size)


@pytest.mark.parametrize("timeout", [float("inf"), 1e300])
def test_an_rpc_timeout_past_the_longest_wait_is_refused_saying_0_means_none(
        timeout: float) -> None:
    # init_rpc failed with "OverflowError: cannot convert float infinity to integer"
    with pytest.raises(ArgumentError, match="rpc_timeout=.* above its limit.*give 0 for no"):
        rpc.TensorPipeRpcBackendOptions(rpc_timeout=timeout)


@pytest.fixture
def one_worker() -> Any:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=30, init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=opts)
    yield
    rpc.shutdown()


@pytest.mark.parametrize("kwargs, message", [
    ({"args": 5}, "args must be a tuple"), ({"args": "ab"}, "args must be a tuple"),
    ({"args": (), "kwargs": [("x", 1)]}, "kwargs must be a dict"),
    ({"args": (), "timeout": float("inf")}, "timeout=inf is above its limit"),
    ({"args": (), "timeout": 1e300}, "above its limit"),
])
def test_a_call_with_bad_args_kwargs_or_timeout_is_refused_naming_it(
        one_worker: None, kwargs: dict[str, Any], message: str) -> None:
    # args=5 failed with "'int' object is not iterable"; timeout=inf was taken
    for call in (rpc.rpc_sync, rpc.rpc_async, rpc.remote):
        with pytest.raises(ArgumentError, match=message):
            call("solo", len, **kwargs)
    assert rpc.rpc_sync("solo", len, args=([1, 2],)) == 2


@pytest.mark.parametrize("kwargs", [{"timeout": float("nan")}, {"timeout": float("inf")},
                                    {"graceful": "no"}])
def test_shutdown_with_a_bad_argument_refuses_it_and_leaves_rpc_running(
        one_worker: None, kwargs: dict[str, Any]) -> None:
    # shutdown(timeout=nan) raised, but closed the agent first
    with pytest.raises(ArgumentError, match="timeout|graceful must be True or False"):
        rpc.shutdown(**kwargs)
    assert rpc.rpc_sync("solo", len, args=([1],)) == 1


def test_backward_refuses_a_retain_graph_that_is_not_a_bool(one_worker: None) -> None:
    # "no" failed with a TypeError inside torch's autograd engine
    x = torch.ones(1, requires_grad=True)
    rref = rpc.RRef((x * 2).sum())
    with pytest.raises(ArgumentError, match="RRef.backward: retain_graph must be True or False"):
        rref.backward(retain_graph="no")  # type: ignore[arg-type]
    with tandem.autograd.context() as ctx:
        with pytest.raises(ArgumentError, match="backward: retain_graph must be True or False"):
            tandem.autograd.backward(ctx, [(x * 3).sum()], retain_graph="no")  # type: ignore[arg-type]
        tandem.autograd.backward(ctx, [(x * 3).sum()])
        assert tandem.autograd.get_gradients(ctx)[x].item() == 3.0


@pytest.mark.parametrize("kwargs, message", [
    ({"device_maps": 5}, "device_maps must be a dict"),
    ({"device_maps": [("w1", {"cpu": "cpu"})]}, "device_maps must be a dict"),
    ({"devices": "cpu"}, "devices must be a list, got 'cpu'"),
])
def test_options_refuse_device_maps_and_devices_of_the_wrong_kind(
        kwargs: dict[str, Any], message: str) -> None:
    # device_maps=5 failed with an AttributeError; devices="cpu" was read letter by letter
    with pytest.raises(ArgumentError, match=message):
        rpc.TensorPipeRpcBackendOptions(**kwargs)
    assert rpc.TensorPipeRpcBackendOptions(devices=["cpu"], device_maps={"w1": {"cpu": "cpu"}}
                                           ).devices == [torch.device("cpu")]
