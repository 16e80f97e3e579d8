"""DiLoCo: equals DDP where it should, matches a one-process oracle, resumes from a state dict.

The rank processes (4 ranks, one spawn for every case) train small MLPs on rank-dependent
data. The oracle runs in the test process: it trains the 4 replicas one after another and
applies the outer steps (streaming, delays and compression included) from the algorithm's
definition, written here without DiLoCo's code.

Run: ``python -m pytest tests/algorithms/test_diloco.py -q``.
"""

from __future__ import annotations

import copy
import math
import time
import traceback
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tandem.algorithms.diloco import DiLoCo
from tandem.errors import ArgumentError
from tandem.testing import spawn

WORLD = 4
BATCH = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7919 * step + 31 * rank + 5)
    return torch.randn(BATCH, 10, generator=gen), torch.randn(BATCH, 3, generator=gen)


def _inner_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _nesterov(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _plain(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


def _inner(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)


# ---- cases, run in the rank processes ------------------------------------------------------

def _ddp_equal(rank: int, world: int) -> dict[str, Any]:
    """H=1, plain SGD inside, SGD(lr=1) outside: the same weights as DDP."""
    from tandem.parallel.ddp import DistributedDataParallel as DDP

    ddp = DDP(_model())
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, opt, outer_optimizer=_plain, sync_every=1)
    for step in range(6):
        _inner_step(ddp, ddp_opt, rank, step)
        _inner_step(model, opt, rank, step)
        diloco.step()
    diff = max((a - b).abs().max().item()
               for a, b in zip(model.parameters(), ddp.module.parameters()))
    return {"diff": diff, "outer_steps": diloco.outer_steps}


STREAM_CONFIGS: dict[str, dict[str, Any]] = {
    "plain_h3": {"sync_every": 3},
    "stream_f2_d1": {"sync_every": 4, "fragments": 2, "delay": 1},
    "stream_f3_d3": {"sync_every": 4, "fragments": 3, "delay": 3},
    "stream_f2_d0": {"sync_every": 4, "fragments": 2, "delay": 0},
    "more_fragments_than_h": {"sync_every": 2, "fragments": 3},  # two start at one step
    "bf16_h3": {"sync_every": 3, "compression": "bf16"},
    "int8_f2_d2": {"sync_every": 4, "fragments": 2, "delay": 2, "compression": "int8",
                   "block_size": 8},
}
STEPS = 11  # ends with exchanges in flight in the streaming configurations


def _trained(rank: int, config: dict[str, Any]) -> dict[str, Any]:
    model = _model()
    opt = _inner(model)
    diloco = DiLoCo(model, opt, outer_optimizer=_nesterov, **config)
    for step in range(STEPS):
        _inner_step(model, opt, rank, step)
        diloco.step()
    out = {"params": [p.detach().clone() for p in model.parameters()],
           "outer": [p.clone() for p in diloco.outer_params],
           "bytes": diloco.bytes_sent, "outer_steps": diloco.outer_steps}
    diloco.sync()  # nothing in flight when the group goes, as at the end of a training run
    return out


def _round_trip(rank: int, config: dict[str, Any]) -> dict[str, Any]:
    """Train 5 steps, save; go on 6 steps, and separately load the save into new objects and
    go on 6 steps: the weights must be the same."""
    def build() -> tuple[nn.Module, torch.optim.Optimizer, DiLoCo]:
        model = _model()
        opt = _inner(model)
        return model, opt, DiLoCo(model, opt, outer_optimizer=_nesterov, **config)

    model, opt, diloco = build()
    for step in range(5):
        _inner_step(model, opt, rank, step)
        diloco.step()
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                           "diloco": diloco.state_dict()})
    in_flight = len(saved["diloco"]["pending"])
    for step in range(5, 11):
        _inner_step(model, opt, rank, step)
        diloco.step()
    model2, opt2, diloco2 = build()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    diloco2.load_state_dict(saved["diloco"])
    for step in range(5, 11):
        _inner_step(model2, opt2, rank, step)
        diloco2.step()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(),
                                                          model2.parameters()))
    diloco.sync()
    diloco2.sync()
    return {"diff": diff, "in_flight": in_flight,
            "counters": (diloco.inner_steps, diloco.outer_steps)
            == (diloco2.inner_steps, diloco2.outer_steps)}


def _hidden(rank: int, world: int) -> dict[str, Any]:
    """Exchanges that complete before their finishing step are fully hidden; with delay=0
    none is. Completion is awaited by polling the work, never by a fixed sleep."""
    model = _model()
    opt = _inner(model)
    overlapped = DiLoCo(model, opt, outer_optimizer=_nesterov, sync_every=2, fragments=2,
                        delay=1)
    for step in range(8):
        _inner_step(model, opt, rank, step)
        overlapped.step()
        deadline = time.monotonic() + 60
        for ex in overlapped._pending:  # the "compute" lasts until the exchange arrived
            while ex.work is not None and not ex.work.is_completed():
                assert time.monotonic() < deadline, "exchange did not complete in 60 s"
                time.sleep(0.001)
    blocking = DiLoCo(model, opt, outer_optimizer=_nesterov, sync_every=2)
    for step in range(4):
        _inner_step(model, opt, rank, step)
        blocking.step()
    out = {"overlapped": (overlapped.hidden_fraction, overlapped.exposed_seconds,
                          overlapped.comm_seconds),
           "blocking": (blocking.hidden_fraction, blocking.comm_seconds)}
    overlapped.sync()
    blocking.sync()
    return out


def _hierarchical(rank: int, world: int, compression: str | None) -> dict[str, Any]:
    """2 hosts of 2 ranks: DDP inside each host, DiLoCo across; the host's ranks carry one
    slice each, and the result is that of each rank carrying the whole model."""
    from tandem.algorithms.diloco import host_groups
    from tandem.parallel.ddp import DistributedDataParallel as DDP

    host, cross = host_groups(2)
    runs = {}
    for sliced in (True, False):
        net = _model()
        ddp = DDP(net, process_group=host)
        opt = _inner(net)
        diloco = DiLoCo(net, opt, outer_optimizer=_nesterov, sync_every=3, fragments=2,
                        delay=1, compression=compression, group=cross,
                        host_group=host if sliced else None)
        for step in range(STEPS):
            _inner_step(ddp, opt, rank // 2, step)  # a host's ranks split one batch's data
            diloco.step()
        runs[sliced] = ([p.detach().clone() for p in net.parameters()], diloco.bytes_sent)
        diloco.sync()
    diff = max((a - b).abs().max().item() for a, b in zip(runs[True][0], runs[False][0]))
    return {"diff": diff, "bytes": (runs[True][1], runs[False][1]),
            "params": runs[True][0]}


WIDE = 100  # a fragment of the wide model: 10,100 values, 40 kB, below the ring threshold


def _counting_writes(tcp: Any, written: list[int]) -> Callable[..., None]:
    """The TCP transport's writer, counting the bytes the kernel took into ``written``."""
    send = tcp._sendall_vec

    def counting(sock: Any, parts: list[memoryview], flags: int = 0) -> None:
        before = sum(p.nbytes for p in parts)
        try:
            send(sock, parts, flags)
        finally:  # parts holds what was not sent
            written[0] += before - sum(p.nbytes for p in parts)
    return counting


def _equal_start_bytes(rank: int, world: int) -> dict[str, Any]:
    """Ranks built from one seed already agree: DiLoCo's start sends no parameters."""
    import tandem as dist
    from tandem.transport import tcp

    dist.barrier()
    written = [0]
    send = tcp._sendall_vec
    tcp._sendall_vec = _counting_writes(tcp, written)
    try:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(WIDE, WIDE), nn.Linear(WIDE, WIDE))
        DiLoCo(net, _inner(net), outer_optimizer=_plain, sync_every=2)
    finally:
        tcp._sendall_vec = send
    return {"wire": written[0]}


def _wire_bytes(rank: int, world: int) -> dict[str, Any]:
    """Streaming DiLoCo's exchanges of 40 kB fragments: the bytes this rank's TCP
    transport hands the kernel, counted around its writes (headers included)."""
    import tandem as dist
    from tandem.transport import tcp

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(WIDE, WIDE), nn.Linear(WIDE, WIDE))
    opt = _inner(net)
    diloco = DiLoCo(net, opt, outer_optimizer=_nesterov, sync_every=4, fragments=2, delay=2)
    dist.barrier()  # the set-up's broadcast and earlier cases are off the wire
    written = [0]
    send = tcp._sendall_vec
    tcp._sendall_vec = _counting_writes(tcp, written)
    try:
        for step in range(8):
            x = torch.randn(8, WIDE, generator=torch.Generator().manual_seed(rank + 10 * step))
            net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            diloco.step()
        diloco.sync()
    finally:
        tcp._sendall_vec = send
    return {"wire": written[0], "counted": diloco.bytes_sent,
            "exchanges": diloco.outer_steps}


def _host_groups_refusal(rank: int, world: int) -> str:
    from tandem.algorithms.diloco import host_groups

    try:
        host_groups(3)
    except ArgumentError as exc:
        return str(exc)
    return "accepted"


def _hierarchy_refusals(rank: int, world: int) -> list[str]:
    """host_group without a cross-host group, or with the world as one, is refused."""
    from tandem.algorithms.diloco import host_groups
    from tandem.collectives.world import default_group

    host, _ = host_groups(2)
    out = []
    for group in (None, default_group()):
        net = _model()
        try:
            DiLoCo(net, _inner(net), outer_optimizer=_plain, sync_every=2, group=group,
                   host_group=host)
            out.append("accepted")
        except ArgumentError as exc:
            out.append(str(exc))
    return out


def _starts_equal(rank: int, world: int) -> list[torch.Tensor]:
    """Ranks built with different weights all start from rank 0's, outer ones included."""
    torch.manual_seed(rank)
    net = nn.Linear(5, 4)
    diloco = DiLoCo(net, _inner(net), outer_optimizer=_plain, sync_every=2)
    assert all(torch.equal(p, o) for p, o in zip(net.parameters(), diloco.outer_params))
    return [p.detach().clone() for p in net.parameters()]


CASES: dict[str, Callable[[int, int], Any]] = {
    "starts_equal": _starts_equal,
    "host_groups_refusal": _host_groups_refusal,
    "hierarchy_refusals": _hierarchy_refusals,
    "hierarchical": lambda rank, world: _hierarchical(rank, world, None),
    "hierarchical_bf16": lambda rank, world: _hierarchical(rank, world, "bf16"),
    "ddp_equal": _ddp_equal,
    "wire_bytes": _wire_bytes,
    "equal_start_bytes": _equal_start_bytes,
    "hidden": _hidden,
    **{f"trained_{name}": (lambda c: lambda rank, world: _trained(rank, c))(config)
       for name, config in STREAM_CONFIGS.items()},
    "round_trip_stream": lambda rank, world: _round_trip(
        rank, {"sync_every": 4, "fragments": 2, "delay": 2}),
    "round_trip_int8": lambda rank, world: _round_trip(
        rank, {"sync_every": 3, "fragments": 2, "delay": 2, "compression": "int8",
               "block_size": 8}),
}


def run_cases(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fn in CASES.items():
        try:
            out[name] = fn(rank, world)
        except Exception:  # noqa: BLE001 - reported per case
            out[name] = {"error": traceback.format_exc()}
            raise
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(WORLD, run_cases, timeout=500)  # generous: 13 s idle, 124 s seen at load


def _case(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r[name] for r in results]


# ---- the oracle: 4 replicas in one process -------------------------------------------------

def _fragments(sizes: list[int], count: int) -> list[list[int]]:
    """Whole tensors, consecutive, each fragment as near to total/count elements as the
    greedy cut gets (the documented split)."""
    total, out, start, acc = sum(sizes), [], 0, 0
    for f in range(count - 1):
        end = start + 1
        acc += sizes[start]
        target = total * (f + 1) / count
        while end < len(sizes) - (count - 1 - f) and abs(acc + sizes[end] - target) <= abs(acc - target):
            acc += sizes[end]
            end += 1
        out.append(list(range(start, end)))
        start = end
    out.append(list(range(start, len(sizes))))
    return out


def _roundtrip_codec(x: torch.Tensor, kind: str | None, block: int) -> torch.Tensor:
    if kind is None:
        return x
    if kind == "bf16":
        return x.to(torch.bfloat16).to(torch.float32)
    out = torch.empty_like(x)
    for b in range(0, x.numel(), block):
        part = x[b:b + block]
        scale = part.abs().max() / 127.0
        if scale == 0:
            scale = torch.tensor(1.0)
        out[b:b + block] = torch.round(part / scale).clamp(-127, 127) * scale
    return out


def _average(pgs: list[torch.Tensor], kind: str | None, block: int) -> torch.Tensor:
    """The average every rank ends up with."""
    if kind is None:
        return sum((g / WORLD for g in pgs), torch.zeros_like(pgs[0]))
    n = pgs[0].numel()
    per = block * WORLD
    padded_n = math.ceil(n / per) * per
    chunk = padded_n // WORLD
    padded = [torch.cat([g, torch.zeros(padded_n - n)]) for g in pgs]
    avg = torch.empty(padded_n)
    for c in range(WORLD):  # chunk c: owner c sums the decoded contributions in rank order
        part = slice(c * chunk, (c + 1) * chunk)
        total = torch.zeros(chunk)
        for g in padded:
            total += _roundtrip_codec(g[part], kind, block)
        avg[part] = _roundtrip_codec(total / WORLD, kind, block)
    return avg[:n]


def _oracle(config: dict[str, Any]) -> list[list[torch.Tensor]]:
    h = config["sync_every"]
    count = config.get("fragments", 1)
    delay = config.get("delay", 0 if count == 1 else max(1, h // count))  # the documented default
    kind = config.get("compression")
    block = config.get("block_size", 256)
    models = [_model() for _ in range(WORLD)]
    opts = [_inner(m) for m in models]
    params = [list(m.parameters()) for m in models]
    outer = [p.detach().clone() for p in params[0]]
    outer_opt = _nesterov(outer)
    frags = _fragments([p.numel() for p in outer], count)
    flight: list[tuple[int, int, list[torch.Tensor], list[torch.Tensor]]] = []
    for t in range(1, STEPS + 1):
        for r in range(WORLD):
            _inner_step(models[r], opts[r], r, t - 1)
        for item in [f for f in flight if f[1] == t] if delay else []:
            flight.remove(item)
            _land(item, frags, params, outer, outer_opt, kind, block)
        for f in range(count):
            if t % h == (f + 1) * h // count % h:
                flat = [torch.cat([params[r][i].detach().reshape(-1) for i in frags[f]])
                        for r in range(WORLD)]
                outer_flat = torch.cat([outer[i].reshape(-1) for i in frags[f]])
                item = (f, t + delay, flat, [outer_flat - x for x in flat])
                if delay:
                    flight.append(item)
                else:
                    _land(item, frags, params, outer, outer_opt, kind, block)
    return [[p.detach().clone() for p in ps] for ps in params]


def _land(item: Any, frags: list[list[int]], params: list[list[nn.Parameter]],
          outer: list[torch.Tensor], outer_opt: torch.optim.Optimizer,
          kind: str | None, block: int) -> None:
    f, _, at_start, pgs = item
    avg = _average(pgs, kind, block)
    off = 0
    for p in outer:
        p.grad = None
    for i in frags[f]:
        n = outer[i].numel()
        outer[i].grad = avg[off:off + n].view_as(outer[i]).clone()
        off += n
    outer_opt.step()
    with torch.no_grad():
        for r in range(len(params)):
            off = 0
            for i in frags[f]:
                p = params[r][i]
                n = p.numel()
                progress = p.reshape(-1) - at_start[r][off:off + n]
                p.copy_((outer[i].reshape(-1) + progress).view_as(p))
                off += n


# ---- tests ---------------------------------------------------------------------------------

@pytest.mark.procs
@pytest.mark.timeout(600)
def test_h1_with_plain_sgd_equals_ddp(results: Any) -> None:
    for rank, info in enumerate(_case(results, "ddp_equal")):
        assert info["outer_steps"] == 6
        assert info["diff"] <= 1e-6, f"rank {rank}: DiLoCo differs from DDP by {info['diff']}"


@pytest.mark.procs
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(STREAM_CONFIGS))
def test_matches_the_one_process_oracle(results: Any, name: str) -> None:
    expected = _oracle(STREAM_CONFIGS[name])
    per_rank = _case(results, f"trained_{name}")
    for rank, info in enumerate(per_rank):
        worst = max((a - b).abs().max().item() for a, b in zip(info["params"], expected[rank]))
        assert worst <= 1e-5, f"{name}, rank {rank}: differs from the oracle by {worst}"
        # the outer parameters are the same on every rank, compressed or not
        for a, b in zip(info["outer"], per_rank[0]["outer"]):
            assert torch.equal(a, b), f"{name}: outer parameters differ between ranks"


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_bytes_sent_follow_the_payload_and_the_compression(results: Any) -> None:
    numel = sum(p.numel() for p in _model().parameters())
    plain = _case(results, "trained_plain_h3")[0]
    # 3 syncs of the whole model (2.9 kB: below the ring's threshold), each a reduce-scatter
    # and an all-gather of the (padded) payload: 2 (W-1)/W of it, not doubling's 2 swaps
    padded = math.ceil(numel / WORLD) * WORLD
    assert plain["bytes"] == 3 * 2 * (WORLD - 1) * padded * 4 // WORLD
    bf16 = _case(results, "trained_bf16_h3")[0]
    padded = math.ceil(numel / WORLD) * WORLD  # bf16 chunks need no block alignment
    assert bf16["bytes"] == 3 * 2 * ((WORLD - 1) * padded * 2 // WORLD)
    # per (padded) element, half the bytes a ring of fp32 would send
    assert bf16["bytes"] / padded == pytest.approx(3 * 2 * (WORLD - 1) * 4 / WORLD / 2,
                                                   rel=1e-3)


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_small_fragments_cross_the_wire_once_and_a_half_not_twice(results: Any) -> None:
    """A fragment below the ring's threshold would go by recursive doubling (2 payloads
    sent per rank at 4 ranks); DiLoCo sends it as a reduce-scatter and an all-gather
    (1.5 payloads), so streaming's bytes per step are plain DiLoCo's, 1/H of DDP's."""
    fragment = (WIDE * WIDE + WIDE) * 4
    for rank, info in enumerate(_case(results, "wire_bytes")):
        assert info["exchanges"] == 4, info
        ring = 4 * 2 * (WORLD - 1) * fragment // WORLD
        assert info["counted"] == ring, (rank, info)
        # headers are a few dozen bytes per message; doubling would send 4 * 2 * fragment
        assert ring <= info["wire"] <= ring * 1.02, (rank, info, ring)


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_ranks_that_start_equal_send_no_parameters(results: Any) -> None:
    for rank, info in enumerate(_case(results, "equal_start_bytes")):
        # a digest's all-reduce: a few headers; the broadcast would send 40 kB from rank 0
        assert info["wire"] < 2000, (rank, info)


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_state_dict_round_trip_resumes_identically(results: Any) -> None:
    for name in ("round_trip_stream", "round_trip_int8"):
        for rank, info in enumerate(_case(results, name)):
            assert info["in_flight"] >= 1, f"{name}: the save should hold an exchange in flight"
            assert info["counters"]
            assert info["diff"] == 0.0, f"{name}, rank {rank}: resumed run differs by {info['diff']}"


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_overlapped_exchanges_are_counted_as_hidden(results: Any) -> None:
    for info in _case(results, "hidden"):
        fraction, exposed, comm = info["overlapped"]
        assert comm > 0 and exposed == 0.0 and fraction == 1.0, info
        blocking_fraction, blocking_comm = info["blocking"]
        assert blocking_comm > 0 and blocking_fraction < 0.05, info


@pytest.mark.procs
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["hierarchical", "hierarchical_bf16"])
def test_hierarchical_slices_equal_whole_model_exchange_at_half_the_bytes(
        results: Any, name: str) -> None:
    per_rank = _case(results, name)
    for rank, info in enumerate(per_rank):
        assert info["diff"] <= 1e-6, f"{name}, rank {rank}: {info['diff']}"
        sliced, whole = info["bytes"]
        assert 0 < sliced <= whole / 2 + 2048, info["bytes"]  # 2 ranks a host: half, padding aside
        for a, b in zip(info["params"], per_rank[rank ^ 1]["params"]):  # DDP: host-mates equal
            assert (a - b).abs().max().item() <= 1e-6


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_host_groups_refuses_a_local_size_that_does_not_divide_the_world(results: Any) -> None:
    for message in _case(results, "host_groups_refusal"):
        assert message == "host_groups: local_size=3 does not divide the group's 4 ranks"


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_ranks_built_with_different_weights_start_from_the_first_ranks(results: Any) -> None:
    per_rank = _case(results, "starts_equal")
    torch.manual_seed(0)
    want = list(nn.Linear(5, 4).parameters())
    for got in per_rank:
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_host_group_without_a_cross_host_group_is_refused(results: Any) -> None:
    for missing, world in _case(results, "hierarchy_refusals"):
        assert missing.startswith("DiLoCo: host_group needs group= the cross-host group"), missing
        assert "group and host_group share the ranks [" in world, world


def _sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


@pytest.mark.parametrize("kwargs, words", [
    ({"sync_every": 0}, "sync_every (inner steps between outer steps) must be an int >= 1"),
    ({"sync_every": 2.5}, "sync_every"),
    ({"sync_every": 4, "fragments": 7}, "fragments=7 is more than the model's 6"),
    ({"sync_every": 4, "fragments": 0}, "fragments must be an int >= 1"),
    ({"sync_every": 4, "compression": "fp8"}, "compression must be one of None, 'bf16', "
                                              "'int8', got 'fp8'"),
    ({"sync_every": 4, "delay": 5}, "delay=5 is more than sync_every=4"),
    ({"sync_every": 4, "block_size": 0}, "block_size must be an int >= 1"),
    ({"sync_every": 4, "block_size": 10**12}, "block_size=1000000000000 is above its limit of "
                                              "715 .a block longer than the model's 715"),
])
def test_bad_arguments_are_refused_with_the_reason(kwargs: dict[str, Any], words: str) -> None:
    model = _model()
    with pytest.raises(ArgumentError, match=words.replace("(", r"\(").replace(")", r"\)")
                       .replace("'", "'")):
        DiLoCo(model, _inner(model), outer_optimizer=_sgd, **kwargs)


def test_outer_optimizer_must_be_a_builder() -> None:
    model = _model()
    with pytest.raises(ArgumentError, match="outer_optimizer must be a callable"):
        DiLoCo(model, _inner(model), outer_optimizer=_sgd(list(model.parameters())),  # type: ignore[arg-type]
               sync_every=2)
