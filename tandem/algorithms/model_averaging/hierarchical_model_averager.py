"""Hierarchical model averaging (https://arxiv.org/abs/2010.12998): small groups average
often, larger groups less often."""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping
import warnings

from tandem.algorithms.model_averaging import utils
from tandem.algorithms.model_averaging.averagers import ModelAverager, check_count
from tandem.collectives.subgroups import new_subgroups
from tandem.collectives.world import AnyGroup, get_world_size
from tandem.errors import ArgumentError

__all__ = ["HierarchicalModelAverager"]


class HierarchicalModelAverager(ModelAverager):
    """Average over groups of several sizes, each at its own period, after ``warmup_steps``.

    ``period_group_size_dict`` maps a period to a group size, e.g.
    ``OrderedDict([(4, 8), (16, 16)])``: groups of 8 consecutive ranks of
    ``process_group`` average every 4 steps, the whole group every 16. At a step several
    periods divide, only the group of the last such entry averages (it contains the
    others). The last size must be the size of ``process_group``. Every member of
    ``process_group`` must construct the averager (it makes the subgroups).
    """

    def __init__(self, period_group_size_dict: Mapping[int, int] | None = None,
                 warmup_steps: int = 0, process_group: AnyGroup | None = None) -> None:
        what = "HierarchicalModelAverager"
        if not period_group_size_dict:
            raise ArgumentError(f"{what}: period_group_size_dict must map at least one "
                                f"period to a group size, got {period_group_size_dict!r}")
        levels = OrderedDict(
            (check_count(what, "a period in period_group_size_dict", period, 1),
             check_count(what, "a group size in period_group_size_dict", size, 1))
            for period, size in period_group_size_dict.items())
        warmup_steps = check_count(what, "warmup_steps", warmup_steps, 0)
        super().__init__(process_group)
        self._periods = list(levels)
        if self._periods[-1] == 1:
            warnings.warn(f"{what}: the largest period is 1, so parameters are averaged at "
                          f"every step, which costs as much as DDP's gradient all-reduce; "
                          f"use DistributedDataParallel alone", stacklevel=2)
        overall = get_world_size(self.process_group)
        last = list(levels.values())[-1]
        if last != overall:
            raise ArgumentError(f"{what}: the last group size in period_group_size_dict is "
                                f"{last}, but it must be the size of process_group "
                                f"({overall}): the last level averages over all of it")
        self.period_process_group_dict: OrderedDict[int, AnyGroup] = OrderedDict()
        for period, size in levels.items():
            if size == overall:
                self.period_process_group_dict[period] = self.process_group
            else:
                mine, _ = new_subgroups(group_size=size, group=self.process_group)
                assert mine is not None  # every member of process_group is in one subgroup
                self.period_process_group_dict[period] = mine
        self.warmup_steps = warmup_steps

    def _find_process_group(self) -> AnyGroup | None:
        """The group of the last period dividing ``step`` (None: no averaging now)."""
        for period in reversed(self._periods):
            if self.step % period == 0:
                return self.period_process_group_dict[period]
        return None

    def average_parameters(self, params: utils.Params) -> None:
        """Average ``params`` over the group whose period is due, if any."""
        if self.step >= self.warmup_steps:
            group = self._find_process_group()
            if group is not None:
                utils.average_parameters_or_parameter_groups(params, group)
        self.step += 1
