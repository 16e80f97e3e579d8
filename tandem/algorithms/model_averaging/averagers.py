"""Model averagers: which steps average the parameters, over which group."""

from __future__ import annotations

import abc
import operator
import warnings
from typing import Any

from tandem.algorithms.model_averaging import utils
from tandem.collectives.world import AnyGroup, default_group
from tandem.errors import ArgumentError

__all__ = ["ModelAverager", "PeriodicModelAverager"]


def check_count(what: str, name: str, value: Any, least: int) -> int:
    """``value`` as an int >= ``least`` (numpy integers too: step counts from configs)."""
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or number < least:
        raise ArgumentError(f"{what}: {name} must be an int >= {least}, got {value!r}")
    return number


class ModelAverager(abc.ABC):
    """Base of the averagers: ``process_group`` (None: the default group) and ``step``, the
    number of ``average_parameters`` calls so far (what a checkpoint saves)."""

    def __init__(self, process_group: AnyGroup | None = None) -> None:
        self.process_group: AnyGroup = (process_group if process_group is not None
                                        else default_group())
        self.step = 0

    @abc.abstractmethod
    def average_parameters(self, params: utils.Params) -> None:
        """Called once per training step, after the optimizer's step."""


class PeriodicModelAverager(ModelAverager):
    """Average over ``process_group`` at every ``period``-th step once ``warmup_steps``
    steps have passed: at steps ``warmup_steps``, ``warmup_steps + period``, ...

    Pair it with DDP's ``post_localSGD_hook`` (``start_localSGD_iter == warmup_steps``)
    or use it through ``tandem.optim.PostLocalSGDOptimizer``.
    """

    def __init__(self, period: int, warmup_steps: int = 0,
                 process_group: AnyGroup | None = None) -> None:
        warmup_steps = check_count("PeriodicModelAverager", "warmup_steps", warmup_steps, 0)
        period = check_count("PeriodicModelAverager", "period", period, 1)
        super().__init__(process_group)
        if period == 1:
            warnings.warn("PeriodicModelAverager: period=1 averages the parameters at every "
                          "step, which costs as much as DDP's gradient all-reduce; use "
                          "DistributedDataParallel alone", stacklevel=2)
        self.warmup_steps = warmup_steps
        self.period = period

    def average_parameters(self, params: utils.Params) -> None:
        """Average ``params`` (parameters or parameter groups) if this step is due."""
        since = self.step - self.warmup_steps
        if since >= 0 and since % self.period == 0:
            utils.average_parameters_or_parameter_groups(params, self.process_group)
        self.step += 1
