"""``Join``: training on uneven inputs, as ``torch.distributed.algorithms.join``.

When ranks hold different numbers of batches, a rank that runs out leaves the loop
while the others still issue collectives, and they would wait for it forever. Inside
``with Join([...])`` a rank that has left *shadows* the collectives of the ranks still
training, one training iteration at a time, until every rank has left::

    from tandem.algorithms.join import Join
    model = DistributedDataParallel(net)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    with Join([model, opt]):                  # DDP first: its collectives come first
        for x, y in my_uneven_batches:
            loss_fn(model(x), y).backward()
            opt.step()
    # every rank gets here, with the same parameters (those of the last rank to leave)

Each participant is a :class:`Joinable`; its :class:`JoinHook` says what a joined rank
does for one iteration of the others (``main_hook``) and once all have joined
(``post_hook``). A Joinable calls :meth:`Join.notify_join_context` before its
collectives of an iteration; the first one in the list then tells the joined ranks,
with one all-reduce, that this rank is still training.

Beyond torch: the bookkeeping all-reduces carry one int32 flag per rank, so a
collective of the training loop that no hook shadows (say, an all-reduce of the
loss) meets a tensor of another shape and raises
:class:`~tandem.errors.CollectiveMismatchError` naming both call sites, instead of
adding unrelated numbers; a keyword argument that no Joinable understands is an
:class:`~tandem.errors.ArgumentError` (a misspelt ``divide_by_initial_world_size``
would otherwise do nothing); the Joinables leave join mode when the block ends, so a
later forward does not expect joined peers; and ``throw_on_early_termination``
raises :class:`~tandem.errors.StateError` (a ``RuntimeError``) naming the ranks that
ran out.
"""

from __future__ import annotations

import abc
import types
import warnings
from typing import Any, ClassVar, NamedTuple

import torch

from tandem.collectives.api import all_reduce
from tandem.collectives.group import ProcessGroup
from tandem.collectives.work import Work
from tandem.collectives.world import resolve_group
from tandem.config import flag_argument
from tandem.errors import ArgumentError, StateError

__all__ = ["Join", "Joinable", "JoinHook", "GroupJoinable"]

# shadowed iterations after which a joined rank warns that the inputs are very uneven
SKEW_WARNING = 1000


class JoinHook:
    """What a joined rank does in place of a Joinable's collectives.

    Override :meth:`main_hook` (called once per training iteration of the ranks still
    training: issue the same collectives they issue) and :meth:`post_hook` (called
    once every rank has joined; ``is_last_joiner`` is True on the ranks that joined
    last, which hold the most recent state).
    """

    def main_hook(self) -> None:
        """Shadow one training iteration's collectives of the ranks still training."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Finish once every rank has joined (for example: copy the last joiner's state)."""


class _JoinConfig(NamedTuple):
    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool


_DISABLED = _JoinConfig(False, False, False)


class Joinable(abc.ABC):
    """A participant of :class:`Join`: implement ``join_hook``, ``join_device`` and
    ``join_process_group``, call ``super().__init__()``, and call
    ``Join.notify_join_context(self)`` before the collectives of each iteration.

    ``join_kwargs`` (tandem only) names the keyword arguments of ``Join(...)`` that
    this Joinable's ``join_hook`` understands; None means "any", the default for
    user classes.
    """

    join_kwargs: ClassVar[frozenset[str] | None] = None

    def __init__(self) -> None:
        super().__init__()
        self._join_config = _DISABLED

    @abc.abstractmethod
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a joined rank runs for this Joinable (``kwargs`` come from ``Join``)."""

    @property
    @abc.abstractmethod
    def join_device(self) -> torch.device:
        """The device of the tensors Join's own all-reduces use (tandem: the CPU)."""

    @property
    @abc.abstractmethod
    def join_process_group(self) -> Any:
        """The process group whose ranks join (None: the default group)."""


class GroupJoinable(Joinable):
    """A Joinable whose collectives run on CPU tensors over ``self.process_group``
    (tandem's DDP and ZeroRedundancyOptimizer)."""

    process_group: Any

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return self.process_group


def _config(joinable: Joinable) -> _JoinConfig:
    config = getattr(joinable, "_join_config", None)
    if config is None:
        raise StateError(f"{type(joinable).__name__} has no join configuration: its __init__ "
                         f"must call Joinable.__init__ (super().__init__())")
    assert isinstance(config, _JoinConfig)
    return config


def _flags(group: ProcessGroup, mine: int = 0) -> torch.Tensor:
    """One int32 per group rank: ``mine`` at this rank's place, zero elsewhere."""
    t = torch.zeros(group.group_size, dtype=torch.int32)
    t[group.group_rank] = mine
    return t


def _ranks(group: ProcessGroup, flags: torch.Tensor) -> list[int]:
    return [group.ranks[i] for i in flags.nonzero().flatten().tolist()]


class Join:
    """Context manager that lets ranks leave a training loop at different iterations.

    ``joinables`` are the participants, in the order their collectives occur within
    an iteration; ``enable=False`` turns the whole mechanism off (inputs known to be
    even); ``throw_on_early_termination=True`` makes every rank raise as soon as one
    rank has run out, instead of shadowing. Other keyword arguments go to every
    Joinable's ``join_hook`` (DDP: ``divide_by_initial_world_size``).
    """

    def __init__(self, joinables: list[Joinable], enable: bool = True,
                 throw_on_early_termination: bool = False, **kwargs: Any) -> None:
        # enable="no" and throw_on_early_termination="no" were read as True
        self._enable = flag_argument("Join: enable", enable)
        self._throw = flag_argument("Join: throw_on_early_termination", throw_on_early_termination)
        joinables = list(joinables)
        if not joinables:
            raise ArgumentError("Join needs at least one Joinable")
        for j in joinables:
            if not isinstance(j, Joinable):
                raise ArgumentError(f"Join takes Joinable objects (tandem's DDP, "
                                    f"ZeroRedundancyOptimizer or a Joinable subclass), got "
                                    f"{type(j).__name__}")
            _config(j)
        self._check_kwargs(joinables, kwargs)
        self._joinables = joinables
        self._group = self._common_group(joinables)
        for j in joinables:
            device = torch.device(j.join_device)
            if device.type != "cpu":
                raise ArgumentError(f"Join: {type(j).__name__}.join_device is {device}; "
                                    f"tandem's collectives take CPU tensors")
        self._hooks = [j.join_hook(**kwargs) for j in joinables]

    @staticmethod
    def _check_kwargs(joinables: list[Joinable], kwargs: dict[str, Any]) -> None:
        known: set[str] = set()
        for j in joinables:
            if j.join_kwargs is None:
                return  # a Joinable that takes any keyword: nothing can be called unknown
            known |= j.join_kwargs
        unknown = sorted(set(kwargs) - known)
        if unknown:
            names = ", ".join(type(j).__name__ for j in joinables)
            raise ArgumentError(f"Join: no Joinable ({names}) understands the keyword "
                                f"argument(s) {unknown}; known: {sorted(known)}")

    @staticmethod
    def _common_group(joinables: list[Joinable]) -> ProcessGroup:
        groups = [resolve_group(j.join_process_group, "Join") for j in joinables]
        for j, g in zip(joinables, groups):
            if g is not groups[0]:
                raise ArgumentError(
                    f"Join: every Joinable must use one process group; {type(j).__name__} "
                    f"uses '{g.group_name}', {type(joinables[0]).__name__} uses "
                    f"'{groups[0].group_name}'")
        return groups[0]

    def __enter__(self) -> "Join":
        for i, j in enumerate(self._joinables):
            j._join_config = _JoinConfig(self._enable, self._throw, i == 0)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: types.TracebackType | None) -> None:
        try:
            if self._enable and exc_type is None:
                self._shadow_until_all_joined()
        finally:
            for j in self._joinables:
                j._join_config = _DISABLED
        # an exception from the block propagates as it is (returning None)

    def _shadow_until_all_joined(self) -> None:
        g = self._group
        is_last_joiner = True
        shadowed = 0
        while True:
            training = _flags(g)  # this rank has joined: it contributes no flag
            all_reduce(training, group=g)
            if not training.any():
                break
            if self._throw:
                self._terminate(training)
            for hook in self._hooks:
                hook.main_hook()
            is_last_joiner = False
            shadowed += 1
            if shadowed == SKEW_WARNING:
                warnings.warn(
                    f"Join: rank {g.ranks[g.group_rank]} has shadowed {shadowed} iterations of "
                    f"rank(s) {_ranks(g, training)}; inputs this uneven waste the joined "
                    f"ranks' time", stacklevel=3)
        for hook in self._hooks:
            hook.post_hook(is_last_joiner)

    def _terminate(self, training: torch.Tensor) -> None:
        g = self._group
        joined = _flags(g, 1)
        all_reduce(joined, group=g)  # answers the check in notify_join_context
        raise StateError(
            f"Join(throw_on_early_termination=True): rank {g.ranks[g.group_rank]} exhausted "
            f"its inputs while rank(s) {_ranks(g, training)} had more; every rank raises")

    @staticmethod
    def notify_join_context(joinable: Joinable) -> Work | None:
        """Tell the joined ranks that this rank still trains (call before each iteration's
        collectives). Only the first Joinable of a Join communicates; with
        ``throw_on_early_termination`` this raises on every rank once one has joined.
        Returns the all-reduce's Work, or None when this call does nothing."""
        config = _config(joinable)
        if not (config.enable and config.is_first_joinable):
            return None
        g = resolve_group(joinable.join_process_group, "Join.notify_join_context")
        work = all_reduce(_flags(g, 1), group=g, async_op=True)
        if config.throw_on_early_termination:
            joined = _flags(g)
            all_reduce(joined, group=g)
            if joined.any():
                raise StateError(
                    f"Join(throw_on_early_termination=True): rank(s) {_ranks(g, joined)} "
                    f"exhausted their inputs; every rank raises (this is rank "
                    f"{g.ranks[g.group_rank]})")
        return work
