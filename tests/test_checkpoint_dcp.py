"""tandem.checkpoint in torch.distributed.checkpoint's form: save(state, checkpoint_id=DIR)
on every rank, load(state, checkpoint_id=DIR) filling the state in place.

The oracle is the state at the time of the save: after more training steps, a load must
bring every tensor (model and optimizer, on every rank) back to exactly those values.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import checkpoint as dcp
from tandem.errors import ArgumentError
from tandem.testing import spawn

pytestmark = pytest.mark.timeout(120)


class AppState:
    """What torch's DCP recipes wrap a model and its optimizer in (a Stateful)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int,
           seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 3, generator=g)).pow(2).sum().backward()
        optimizer.step()


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optim": optimizer.state_dict()})


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_one_process_round_trip_fills_in_place(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    _train(model, optimizer, 3, seed=1)
    saved = _snapshot(model, optimizer)
    state = {"app": AppState(model, optimizer), "step": 3, "extra": torch.arange(4.0)}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    _train(model, optimizer, 2, seed=2)
    weight = model.weight
    state["step"], state["extra"] = 99, torch.zeros(4)
    extra = state["extra"]
    assert dcp.load(state_dict=state, checkpoint_id=tmp_path / "ckpt") is None
    assert _same(_snapshot(model, optimizer), saved)
    assert model.weight is weight and state["extra"] is extra  # filled in place
    assert state["step"] == 3 and extra.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_what_the_checkpoint_lacks_or_holds_otherwise_is_refused_by_name(
        tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(2, 3), "n": 1}, checkpoint_id=tmp_path / "c", no_dist=True)
    with pytest.raises(ArgumentError, match="'missing' is in the state but not in the checkpoint"):
        dcp.load({"w": torch.ones(2, 3), "missing": 0}, checkpoint_id=tmp_path / "c")
    with pytest.raises(ArgumentError, match=r"'w' is torch.float32\[3, 2\] in the state"):
        dcp.load({"w": torch.ones(3, 2)}, checkpoint_id=tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        dcp.load({"w": torch.ones(2, 3)}, checkpoint_id=tmp_path / "none")
    only = {"n": 0}  # keys of the checkpoint beyond the state's are left alone
    dcp.load(only, checkpoint_id=tmp_path / "c")
    assert only == {"n": 1}


@pytest.mark.parametrize("kwargs, message", [
    ({"storage_writer": object()}, "storage_writer"),
    ({"planner": object()}, "planner"),
    ({"use_collectives": False}, "use_collectives"),
])
def test_torchs_plug_ins_are_refused_by_name(tmp_path: Path, kwargs: dict[str, Any],
                                             message: str) -> None:
    with pytest.raises(ArgumentError, match=message):
        dcp.save({"w": torch.ones(1)}, checkpoint_id=tmp_path / "c", **kwargs)
    assert not (tmp_path / "c").exists()
    with pytest.raises(ArgumentError, match="storage_reader"):
        dcp.load({"w": torch.ones(1)}, checkpoint_id=tmp_path / "c", storage_reader=object())


def test_the_file_form_still_needs_its_path() -> None:
    with pytest.raises(ArgumentError, match="path is required"):
        dcp.save({"w": 1})
    with pytest.raises(ArgumentError, match="path is required"):
        dcp.load()


def _ddp_job(rank: int, world: int, directory: str) -> dict[str, Any]:
    from tandem.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, optimizer, 3, seed=10 + rank)  # each rank its own data
    saved = _snapshot(model, optimizer)
    state = {"app": AppState(model, optimizer)}
    dcp.save(state, checkpoint_id=directory)
    files = sorted(p.name for p in Path(directory).iterdir())  # in place on every rank
    _train(model, optimizer, 2, seed=20 + rank)
    moved = not _same(_snapshot(model, optimizer), saved)
    dcp.load(state, checkpoint_id=directory)
    return {"files": files, "moved": moved,
            "restored": _same(_snapshot(model, optimizer), saved)}


@pytest.mark.procs
def test_a_ddp_job_saves_once_and_every_rank_loads_what_it_saved(tmp_path: Path) -> None:
    got = spawn(2, _ddp_job, (str(tmp_path / "ckpt"),), backend="tcp", timeout=90)
    for rank, r in enumerate(got):
        assert r["files"] == ["tandem_state.pt"], (rank, r)
        assert r["moved"] and r["restored"], (rank, r)
