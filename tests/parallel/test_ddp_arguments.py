"""Every argument of torch's DistributedDataParallel is taken by tandem's, in torch's order,
and is either honoured (shown by a check) or refused with a message naming it.

``test_every_torch_parameter_is_accounted_for`` fails when torch adds a parameter, until
someone decides which it is.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.parallel as tparallel
from torch import nn

import tandem
from tandem.errors import ArgumentError
from tandem.parallel import DistributedDataParallel as DDP
from tandem.parallel.ddp import _buffer_sync
from tandem.testing import spawn

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]
HERE = Path(__file__).parent

REFUSED: dict[str, tuple[Any, str]] = {  # parameter: (a value tandem refuses, in the message)
    "device_ids": ([0], "CPU"),
    "output_device": (0, "CPU"),
    "delay_all_reduce_named_params": ([("weight", nn.Parameter(torch.ones(1)))], "leave"),
    "param_to_hook_all_reduce": (nn.Parameter(torch.ones(1)), "delay_all_reduce"),
    "mixed_precision": (object(), "autocast"),
    "device_mesh": (object(), "process_group="),
    "bucket_cap_mb_list": ([1, 25], "bucket_cap_mb"),
    "skip_all_reduce_unused_params": (True, "every bucket"),
}
# parameters shown honoured by tests elsewhere: (file, the test that shows it)
ELSEWHERE = {
    "module": ("test_ddp_training.py", "test_training_equals_single_process_on_concatenated_batch"),
    "process_group": ("test_ddp_across_hosts.py",
                      "test_across_hosts_each_bucket_is_one_all_reduce_and_training_matches"),
    "bucket_cap_mb": ("test_ddp_training.py", "test_tiny_bucket_cap_makes_many_buckets"),
    "find_unused_parameters": ("test_ddp_training.py",
                               "test_find_unused_parameters_with_rank_dependent_graphs"),
    "gradient_as_bucket_view": ("test_ddp_training.py",
                                "test_gradient_as_bucket_view_matches_and_grads_live_in_buckets"),
    "static_graph": ("test_ddp_training.py",
                     "test_static_graph_tolerates_a_parameter_that_is_never_used"),
}
# shown here, by the spawned job below
HERE_SHOWN = {"dim", "broadcast_buffers", "init_sync", "check_reduction", "batched_grad_copy",
              "forward_sync_buffers"}


def _torch_parameters() -> list[str]:
    return [p for p in inspect.signature(tparallel.DistributedDataParallel.__init__).parameters
            if p != "self"]


def test_parameters_are_torchs_in_torchs_order() -> None:
    ours = [p for p in inspect.signature(DDP.__init__).parameters if p != "self"]
    assert ours == _torch_parameters()


def test_every_torch_parameter_is_accounted_for() -> None:
    unaccounted = set(_torch_parameters()) - set(REFUSED) - set(ELSEWHERE) - HERE_SHOWN
    assert not unaccounted, f"DDP parameters neither shown honoured nor refused: {unaccounted}"
    for name, (file, test) in ELSEWHERE.items():
        source = (HERE / file).read_text()
        assert f"{name}" in source and f"def {test}" in source, (name, file, test)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_arguments_raise_naming_the_argument(name: str) -> None:
    value, hint = REFUSED[name]
    with pytest.raises(ArgumentError) as info:
        DDP(nn.Linear(1, 1), **{name: value})
    assert name in str(info.value) and hint in str(info.value), str(info.value)


@pytest.mark.parametrize("name", ["init_sync", "check_reduction", "batched_grad_copy",
                                  "find_unused_parameters", "static_graph",
                                  "gradient_as_bucket_view"])
def test_a_flag_that_is_not_a_bool_is_refused(name: str) -> None:
    with pytest.raises(ArgumentError, match=name):
        DDP(nn.Linear(1, 1), **{name: "yes"})


@pytest.mark.parametrize("cap", ["25", True, [25], float("nan"), 0, -1])
def test_a_bucket_cap_that_is_not_a_positive_number_of_mib_is_refused(cap: object) -> None:
    # "25" failed with a TypeError from a comparison; True made 1 MiB buckets
    with pytest.raises(ArgumentError, match="bucket_cap_mb must be"):
        DDP(nn.Linear(1, 1), bucket_cap_mb=cap)  # type: ignore[arg-type]


def test_the_buffer_arguments_combine_as_torchs() -> None:
    # (broadcast_buffers, forward_sync_buffers) -> (sync at construction, before a forward)
    table = {(None, None): (True, True), (True, None): (True, True),
             (False, None): (False, False), (None, False): (True, False),
             (None, True): (True, True), (False, True): (False, True),
             (True, False): (True, False), (True, True): (True, True),
             (False, False): (False, False)}
    for (bb, fsb), expected in table.items():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert _buffer_sync(bb, fsb) == expected, (bb, fsb)
        assert bool(seen) == (bb is not None and fsb is not None and bb != fsb), (bb, fsb)
    with pytest.warns(UserWarning, match="disagree"):
        assert _buffer_sync(0, 1) == (False, True)  # 0 and 1 pass as False and True
    with pytest.raises(ArgumentError, match="forward_sync_buffers"):
        _buffer_sync(None, "no")  # type: ignore[arg-type]


# -- the behaviour, on 2 ranks ----------------------------------------------------------------
class WithBuffer(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)
        with torch.no_grad():
            self.lin.weight.fill_(float(rank + 1))
        self.register_buffer("count", torch.tensor([10.0 * (rank + 1)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.count


def _states(model: DDP) -> dict[str, float]:
    return {"weight": model.module.lin.weight[0, 0].item(),
            "count": model.module.count.item()}


def _after_forward(model: DDP, rank: int) -> dict[str, float]:
    """Give each rank its own buffer value, run one training forward, read both back."""
    with torch.no_grad():
        model.module.count.fill_(100.0 * (rank + 1))
    model(torch.ones(1, 2)).sum().backward()
    return _states(model)


def _job(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    cases: dict[str, dict[str, Any]] = {
        "default": {}, "no_init_sync": {"init_sync": False},
        "broadcast_off": {"broadcast_buffers": False},
        "forward_off": {"forward_sync_buffers": False},
        "old_off_new_on": {"broadcast_buffers": False, "forward_sync_buffers": True},
    }
    for name, kwargs in cases.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = DDP(WithBuffer(rank), **kwargs)
        out[name] = {"built": _states(model), "forward": _after_forward(model, rank)}
    # dim, check_reduction, batched_grad_copy: accepted; the gradients are the same
    grads = []
    for kwargs in ({}, {"dim": 1, "check_reduction": True, "batched_grad_copy": True}):
        model = DDP(WithBuffer(0), **kwargs)
        x = torch.full((3, 2), float(rank + 1))
        model(x).sum().backward()
        grads.append(model.module.lin.weight.grad.clone())
        if kwargs:
            out["dim"] = model.dim
    out["same_grads"] = bool(torch.equal(grads[0], grads[1]))
    return out


@pytest.fixture(scope="module")
def job() -> list[dict[str, Any]]:
    return spawn(2, _job, backend="tcp", timeout=90)


@pytest.mark.smoke("tandem.parallel")
def test_init_sync_copies_rank_0s_weights_and_buffers_unless_told_not_to(
        job: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(job):
        assert got["default"]["built"] == {"weight": 1.0, "count": 10.0}, (rank, got)
        assert got["no_init_sync"]["built"] == {"weight": rank + 1.0,
                                                 "count": 10.0 * (rank + 1)}, (rank, got)


def test_buffers_follow_broadcast_buffers_and_forward_sync_buffers(
        job: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(job):
        own = 100.0 * (rank + 1)
        # the default: buffers copied from rank 0 at construction and before each forward
        assert got["default"]["forward"]["count"] == 100.0
        # broadcast_buffers=False: never copied
        assert got["broadcast_off"]["built"]["count"] == 10.0 * (rank + 1)
        assert got["broadcast_off"]["forward"]["count"] == own
        # forward_sync_buffers=False: copied at construction only
        assert got["forward_off"]["built"]["count"] == 10.0
        assert got["forward_off"]["forward"]["count"] == own
        # the newer argument decides the forward, the older one the construction
        assert got["old_off_new_on"]["built"]["count"] == 10.0 * (rank + 1)
        assert got["old_off_new_on"]["forward"]["count"] == 100.0


def test_dim_check_reduction_and_batched_grad_copy_are_accepted_and_change_nothing(
        job: list[dict[str, Any]]) -> None:
    for got in job:
        assert got["same_grads"] and got["dim"] == 1


def test_a_ported_call_with_torchs_keywords_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_SECRET", "ddp-arguments-test")
    tandem.init_process_group("tcp", store=tandem.HashStore(), rank=0, world_size=1)
    try:
        model = DDP(nn.Linear(2, 2), device_ids=None, output_device=None, dim=0,
                    broadcast_buffers=None, init_sync=True, process_group=None,
                    bucket_cap_mb=None, find_unused_parameters=False, check_reduction=False,
                    gradient_as_bucket_view=False, static_graph=False,
                    delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                    mixed_precision=None, device_mesh=None,
                    skip_all_reduce_unused_params=False, bucket_cap_mb_list=None,
                    batched_grad_copy=False, forward_sync_buffers=None)
        model(torch.ones(1, 2)).sum().backward()
        assert model.module.weight.grad is not None
        flags = DDP(nn.Linear(2, 2), find_unused_parameters=1, static_graph=0)  # as torch
        assert flags.find_unused_parameters and not flags.static_graph
    finally:
        tandem.destroy_process_group()



@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("TANDEM_SECRET", "ddp-arguments-test")
    tandem.init_process_group("tcp", store=tandem.HashStore(), rank=0, world_size=1)
    yield
    tandem.destroy_process_group()


def test_join_zero_and_ddp_join_refuse_switches_that_are_not_bools(one_rank: None) -> None:
    # "no" was read as True by each of them
    from tandem.algorithms.join import Join
    from tandem.optim import ZeroRedundancyOptimizer

    model = DDP(nn.Linear(2, 2))
    for kwargs in ({"enable": "no"}, {"throw_on_early_termination": "no"}):
        with pytest.raises(ArgumentError, match=f"Join: {next(iter(kwargs))} must be True or False"):
            Join([model], **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="divide_by_initial_world_size must be True or False"):
        model.join(divide_by_initial_world_size="no")  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="divide_by_initial_world_size must be True or False"):
        Join([model], divide_by_initial_world_size="no")
    for name in ("parameters_as_bucket_view", "overlap_with_ddp"):
        with pytest.raises(ArgumentError, match=f"ZeroRedundancyOptimizer: {name} must be True"):
            ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1,
                                    **{name: "no"})
    assert Join([model], enable=False, throw_on_early_termination=True) is not None


def test_a_comm_hook_that_cannot_take_state_and_bucket_is_refused_when_registered(
        one_rank: None) -> None:
    # it failed with a TypeError inside the first backward, on its rank alone
    import functools

    from tandem.parallel import comm_hooks

    def one(bucket: Any) -> Any:
        return bucket

    for hook in (one, lambda: None, functools.partial(comm_hooks.allreduce_hook, None)):
        with pytest.raises(ArgumentError, match=r"called as hook\(state, bucket\)"):
            DDP(nn.Linear(2, 2)).register_comm_hook(None, hook)
    for fine in (comm_hooks.allreduce_hook, comm_hooks.fp16_compress_hook,
                 comm_hooks.powerSGD_hook, lambda *args: args[1].buffer()):
        DDP(nn.Linear(2, 2)).register_comm_hook(None, fine)  # type: ignore[arg-type]
