"""A timeline of 3 DDP steps (``TANDEM_TIMELINE``) is valid Chrome trace JSON with, on every
rank, the forward and backward passes, each bucket's reduction inside its backward pass,
the collectives with their phases, and the optimizer steps; tandem's blocking calls also
show up in ``torch.profiler`` as ``record_function`` ranges."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tandem
from tandem.parallel.ddp import DistributedDataParallel as DDP
from tandem.testing import spawn

pytestmark = pytest.mark.procs

STEPS = 3
CAP_MB = 0.02  # ~20 KB buckets: the model below needs two


def _train(rank: int, world_size: int) -> int:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(),
                              nn.Linear(64, 4)), bucket_cap_mb=CAP_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(STEPS):
        opt.zero_grad()
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
    buckets = len(model.reducer.buckets)
    # writes this rank's timeline; the harness kills the ranks once both have returned
    tandem.destroy_process_group()
    return buckets


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], int]:
    path = tmp_path_factory.mktemp("timeline") / "trace.json"
    # tcp: buckets go through the progress engine, overlapping backward
    buckets = spawn(2, _train, backend="tcp", timeout=90, env={"TANDEM_TIMELINE": str(path)})
    assert buckets[0] == buckets[1] >= 2, buckets
    merged = subprocess.run([sys.executable, "-m", "tandem.trace", "--timeline", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert merged.returncode == 0, merged.stderr
    assert "merged the timelines of ranks 0, 1" in merged.stdout, merged.stdout
    return json.loads(path.read_text()), buckets[0]


def _events(trace: dict[str, Any], rank: int, ph: str = "X") -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["pid"] == rank and e["ph"] == ph]


def test_every_event_is_well_formed_trace_json(trace: Any) -> None:
    data, _ = trace
    assert isinstance(data["traceEvents"], list) and data["otherData"]["ranks"] == [0, 1]
    for e in data["traceEvents"]:
        assert isinstance(e["name"], str) and e["ph"] in ("X", "M", "b", "e"), e
        assert isinstance(e["pid"], int), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], float) and isinstance(e["tid"], int), e
        if e["ph"] in ("b", "e"):
            assert e["cat"] == "ddp" and isinstance(e["id"], str), e
    names = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_has_its_steps_passes_and_optimizer_steps(trace: Any, rank: int) -> None:
    data, _ = trace
    counts = Counter(e["name"] for e in _events(data, rank))
    for name in ("DDP forward", "DDP backward", "optimizer.step (SGD)"):
        assert counts[name] == STEPS, (name, counts)
    spans = sorted(_events(data, rank), key=lambda e: e["ts"])
    order = [e["name"] for e in spans if e["name"] in ("DDP forward", "optimizer.step (SGD)")]
    assert order == ["DDP forward", "optimizer.step (SGD)"] * STEPS, order


@pytest.mark.parametrize("rank", [0, 1])
def test_each_bucket_reduction_runs_inside_its_backward_pass(trace: Any, rank: int) -> None:
    data, buckets = trace
    begins = {e["id"]: e for e in _events(data, rank, "b")}
    ends = {e["id"]: e for e in _events(data, rank, "e")}
    assert set(begins) == set(ends) and len(begins) == buckets * STEPS
    backward = sorted((e["ts"], e["ts"] + e["dur"]) for e in _events(data, rank)
                      if e["name"] == "DDP backward")
    for key, b in begins.items():
        start, end = b["ts"], ends[key]["ts"]
        assert start <= end, key
        step = int(key.split(".")[1]) - 1
        lo, hi = backward[step]
        assert lo <= start and end <= hi + 1.0, (key, start, end, backward[step])


@pytest.mark.parametrize("rank", [0, 1])
def test_collectives_carry_their_call_and_phases_nest_in_them(trace: Any, rank: int) -> None:
    data, buckets = trace
    calls = [e for e in _events(data, rank) if e["cat"] == "tandem"]
    reduces = [c for c in calls if c["name"] == "all_reduce"]
    assert len(reduces) >= buckets * STEPS, Counter(c["name"] for c in calls)
    for c in reduces:
        assert c["args"]["group"] == "default" and c["args"]["bytes"] > 0, c
        assert c["args"]["sig"].startswith("all_reduce float32["), c
    slack = 1.0  # us: timestamps near 1.8e15 us keep ~0.25 us in a JSON double
    for p in (e for e in _events(data, rank) if e["cat"] == "phase"):
        assert p["name"] in ("send", "wait for peers", "transfer", "reduce", "copy"), p
        assert any(c["tid"] == p["tid"] and c["ts"] <= p["ts"] + slack
                   and p["ts"] + p["dur"] <= c["ts"] + c["dur"] + slack for c in calls), p


def test_some_call_waited_for_its_peer(trace: Any) -> None:
    # in every call one of the two ranks arrives first and must wait for the other
    data, _ = trace
    assert any(e["name"] == "wait for peers" for e in data["traceEvents"])


def _profiled(rank: int, world_size: int) -> list[str]:
    t = torch.ones(1024)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        tandem.all_reduce(t)
        tandem.broadcast(t, src=0)
    return sorted({e.name for e in prof.events() if e.name.startswith("tandem.")})


def test_blocking_calls_appear_in_torch_profiler_traces() -> None:
    assert spawn(2, _profiled, timeout=60) == [["tandem.all_reduce", "tandem.broadcast"]] * 2
