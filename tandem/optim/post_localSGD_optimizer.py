"""Post-local SGD as an optimizer: a local optimizer's step, then a model averager's."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from tandem.algorithms.model_averaging.averagers import ModelAverager
from tandem.errors import ArgumentError

__all__ = ["PostLocalSGDOptimizer"]


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """Run ``optim`` at every step, then ``averager.average_parameters`` on its parameter
    groups (torch's ``torch.distributed.optim.PostLocalSGDOptimizer``)::

        averager = PeriodicModelAverager(period=4, warmup_steps=100)
        opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), averager)

    ``state_dict()`` is ``optim``'s with one more entry, ``"step"``: the averager's step
    count, so a resumed run neither warms up again nor shifts its averaging steps.
    """

    # torch.optim.Optimizer.__init__ is not called (as in torch): param_groups and state
    # are the wrapped optimizer's own
    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager) -> None:
        for name, value, needs in (("optim", optim, ("step", "state_dict", "param_groups")),
                                   ("averager", averager, ("average_parameters", "step"))):
            lacking = [n for n in needs if not hasattr(value, n)]
            if lacking:
                raise ArgumentError(f"PostLocalSGDOptimizer: {name}={value!r} has no "
                                    f"{', '.join(lacking)}")
        self.optim = optim
        self.param_groups = optim.param_groups
        self.averager = averager

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    def __repr__(self) -> str:
        return repr(self.optim)

    def state_dict(self) -> dict[str, Any]:
        """``optim.state_dict()`` plus ``"step"``, the averager's step count."""
        out = self.optim.state_dict()
        out["step"] = self.averager.step
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``optim``'s state and the averager's step (0, with a warning, when the
        state dict has no ``"step"``)."""
        self.optim.load_state_dict(state_dict)
        if "step" in state_dict:
            self.averager.step = state_dict["step"]
        else:
            warnings.warn("PostLocalSGDOptimizer.load_state_dict: the state dict has no "
                          "'step' (the averager's step count); the averager starts again "
                          "from step 0", stacklevel=2)
            self.averager.step = 0

    def step(self) -> None:  # type: ignore[override]
        """The local optimizer's step, then the averager's."""
        self.optim.step()
        self.averager.average_parameters(params=self.param_groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)
