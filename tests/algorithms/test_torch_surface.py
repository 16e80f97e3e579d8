"""Porting is changing imports: ZeRO, Join and DataParallel take torch's parameters.

Every parameter torch documents for these names can be passed to tandem's by the
same name and at the same position, with the same default.

Run: ``python -m pytest tests/algorithms/test_torch_surface.py -q``.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from typing import Any, Callable

import pytest
import torch.distributed.algorithms.join as torch_join
import torch.nn.parallel as torch_parallel
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem.algorithms.join as our_join
import tandem.optim as our_optim
import tandem.parallel as our_parallel
from tandem.parallel import DistributedDataParallel as OurDDP

with warnings.catch_warnings():  # torch.distributed.optim scripts its functional optimizers
    warnings.simplefilter("ignore", DeprecationWarning)
    import torch.distributed.optim as torch_optim
    from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook as torch_zero_hook
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_local
    from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
    from torch.distributed.algorithms.model_averaging import (
        hierarchical_model_averager as torch_hier,
    )
    from torch.distributed.algorithms.model_averaging import utils as torch_avg_utils

import tandem.algorithms.ddp_comm_hooks.post_localSGD_hook as our_local
import tandem.algorithms.model_averaging.averagers as our_averagers
import tandem.algorithms.model_averaging.hierarchical_model_averager as our_hier
import tandem.algorithms.model_averaging.utils as our_avg_utils

PAIRS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "ZeroRedundancyOptimizer": (torch_optim.ZeroRedundancyOptimizer.__init__,
                                our_optim.ZeroRedundancyOptimizer.__init__),
    "ZeroRedundancyOptimizer.step": (torch_optim.ZeroRedundancyOptimizer.step,
                                     our_optim.ZeroRedundancyOptimizer.step),
    "ZeroRedundancyOptimizer.consolidate_state_dict": (
        torch_optim.ZeroRedundancyOptimizer.consolidate_state_dict,
        our_optim.ZeroRedundancyOptimizer.consolidate_state_dict),
    "ZeroRedundancyOptimizer.load_state_dict": (
        torch_optim.ZeroRedundancyOptimizer.load_state_dict,
        our_optim.ZeroRedundancyOptimizer.load_state_dict),
    "ZeroRedundancyOptimizer.add_param_group": (
        torch_optim.ZeroRedundancyOptimizer.add_param_group,
        our_optim.ZeroRedundancyOptimizer.add_param_group),
    "hook_with_zero_step": (torch_zero_hook.hook_with_zero_step, our_optim.hook_with_zero_step),
    "hook_with_zero_step_interleaved": (torch_zero_hook.hook_with_zero_step_interleaved,
                                        our_optim.hook_with_zero_step_interleaved),
    "Join": (torch_join.Join.__init__, our_join.Join.__init__),
    "Join.notify_join_context": (torch_join.Join.notify_join_context,
                                 our_join.Join.notify_join_context),
    "JoinHook.post_hook": (torch_join.JoinHook.post_hook, our_join.JoinHook.post_hook),
    "DistributedDataParallel": (TorchDDP.__init__, OurDDP.__init__),
    "DistributedDataParallel.join": (TorchDDP.join, OurDDP.join),
    "DataParallel": (torch_parallel.DataParallel.__init__, our_parallel.DataParallel.__init__),
    "data_parallel": (torch_parallel.data_parallel, our_parallel.data_parallel),
    "scatter": (torch_parallel.scatter, our_parallel.scatter),
    "gather": (torch_parallel.gather, our_parallel.gather),
    "replicate": (torch_parallel.replicate, our_parallel.replicate),
    "parallel_apply": (torch_parallel.parallel_apply, our_parallel.parallel_apply),
    **{f"PostLocalSGDOptimizer.{m}": (getattr(torch_optim.PostLocalSGDOptimizer, m),
                                      getattr(our_optim.PostLocalSGDOptimizer, m))
       for m in ("__init__", "state_dict", "load_state_dict", "step", "zero_grad",
                 "add_param_group")},
    **{f"{cls}.{m}": (getattr(getattr(mod, cls), m), getattr(getattr(ours, cls), m))
       for mod, ours, cls in ((torch_averagers, our_averagers, "ModelAverager"),
                              (torch_averagers, our_averagers, "PeriodicModelAverager"),
                              (torch_hier, our_hier, "HierarchicalModelAverager"))
       for m in ("__init__", "average_parameters")},
    **{f"model_averaging.utils.{f}": (getattr(torch_avg_utils, f), getattr(our_avg_utils, f))
       for f in torch_avg_utils.__all__},
    "PostLocalSGDState": (torch_local.PostLocalSGDState.__init__,
                          our_local.PostLocalSGDState.__init__),
    "PostLocalSGDState.maybe_increase_iter": (torch_local.PostLocalSGDState.maybe_increase_iter,
                                              our_local.PostLocalSGDState.maybe_increase_iter),
    "post_localSGD_hook": (torch_local.post_localSGD_hook, our_local.post_localSGD_hook),
    "scatter_kwargs": (importlib.import_module("torch.nn.parallel.scatter_gather").scatter_kwargs,
                       importlib.import_module("tandem.parallel.scatter_gather").scatter_kwargs),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_parameters_match_torch_by_name_position_and_default(name: str) -> None:
    theirs_fn, ours_fn = PAIRS[name]
    theirs = inspect.signature(theirs_fn).parameters
    ours = inspect.signature(ours_fn).parameters
    missing = [p for p in theirs if p not in ours]
    assert not missing, f"tandem's {name} lacks torch's parameters {missing}"
    assert list(ours)[:len(theirs)] == list(theirs), (
        f"{name}: tandem's parameter order {list(ours)} differs from torch's {list(theirs)}")
    for p, spec in theirs.items():
        assert spec.default == ours[p].default or spec.default is inspect.Parameter.empty, (
            f"{name}({p}=...): torch's default {spec.default!r}, tandem's {ours[p].default!r}")


def test_public_names_exist_where_torch_has_them() -> None:
    for name in ("Join", "Joinable", "JoinHook"):
        assert hasattr(our_join, name), name
    for name in ("DataParallel", "data_parallel", "scatter", "gather", "replicate",
                 "parallel_apply", "DistributedDataParallel"):
        assert name in our_parallel.__all__, name
    assert "ZeroRedundancyOptimizer" in our_optim.__all__
    ported = importlib.import_module("tandem.algorithms.ddp_comm_hooks.ddp_zero_hook")
    assert ported.hook_with_zero_step is our_optim.hook_with_zero_step
    package = importlib.import_module("tandem.algorithms")  # torch's package-level names
    assert (package.Join, package.JoinHook, package.Joinable) == (
        our_join.Join, our_join.JoinHook, our_join.Joinable)
    power = importlib.import_module("tandem.algorithms.ddp_comm_hooks.powerSGD_hook")
    comm_hooks = importlib.import_module("tandem.parallel.comm_hooks")
    assert power.PowerSGDState is comm_hooks.PowerSGDState
    assert power.powerSGD_hook is comm_hooks.powerSGD_hook
    assert "PostLocalSGDOptimizer" in our_optim.__all__
    for module, names in ((our_averagers, torch_averagers.__all__),
                          (our_avg_utils, torch_avg_utils.__all__),
                          (our_local, ["PostLocalSGDState", "post_localSGD_hook"]),
                          (our_hier, ["HierarchicalModelAverager"])):
        missing = [n for n in names if not hasattr(module, n)]
        assert not missing, f"{module.__name__} lacks torch's {missing}"
    assert package.model_averaging.averagers is our_averagers
