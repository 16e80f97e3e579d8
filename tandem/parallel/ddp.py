"""``DistributedDataParallel``: data-parallel training on tandem's collectives.

Same constructor and behaviour as ``torch.nn.parallel.DistributedDataParallel``::

    import tandem as dist
    from tandem.parallel.ddp import DistributedDataParallel as DDP

    dist.init_process_group()                  # under tandemrun / torchrun
    model = DDP(Net())                         # checks every rank built the same Net,
                                               # then copies rank 0's weights everywhere
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()        # gradients arrive averaged over ranks
        opt.step()
    print(model.stats)                         # forward/backward/communication times

Gradients are reduced in buckets while backward is still running (see
``tandem.parallel._reducer``). Where torch would hang or silently diverge, this
class raises: different models on different ranks (:class:`~tandem.errors.ArgumentError`
naming the parameter and the ranks), and a parameter that got no gradient without
``find_unused_parameters=True`` (:class:`~tandem.errors.StateError` naming it, raised
by ``backward()`` on every rank instead of a hang).

Uneven inputs: DDP is a :class:`~tandem.algorithms.join.Joinable`; ``with
ddp.join():`` (or ``Join([ddp, optimizer])``) lets ranks run out of batches at
different iterations (see ``tandem.parallel._ddp_join``).

Differences from torch, on purpose: buffers are broadcast before a forward only in
training mode (an eval-mode forward run by one rank alone cannot hang), and the
module must live on the CPU (``device_ids`` must be None), as tandem's collectives do,
and its gradients must be dense (an embedding with ``sparse=True`` is refused unless left
out through torch's ignore list).
Buckets are not rebuilt after the first iteration.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
from typing import Any, Callable, Iterator

import torch
from torch import nn

from tandem.algorithms.join import GroupJoinable, Join, Joinable, JoinHook
from tandem.collectives.group import NonMemberGroup, ProcessGroup
from tandem.collectives.world import resolve_group
from tandem.config import at_most, flag_argument, memory_limit, memory_text
from tandem.errors import ArgumentError, StateError
from tandem.parallel._buckets import FIRST_BUCKET_BYTES, GradBucket
from tandem.parallel._ddp_join import BUFFERS, SYNC, TRAINING, DDPJoinHook, join_round
from tandem.parallel._ddp_stats import DDPStats, StepTimes
from tandem.parallel._module_sync import (
    BufferBroadcaster,
    broadcast_tensors,
    describe_module,
    verify_same_model,
)
from tandem.parallel._observer import ObservingHook
from tandem.parallel._reducer import Reducer
from tandem.parallel.comm_hooks import allreduce_hook

__all__ = ["DistributedDataParallel", "DDPStats", "StepTimes", "GradBucket"]


def _ignored(module: nn.Module) -> set[str]:
    # torch's convention for excluding parameters/buffers from DDP
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()) or ())


_UNSUPPORTED = {
    "delay_all_reduce_named_params": "tandem reduces every parameter's gradient during "
                                     "backward; leave these parameters out of the DDP module",
    "param_to_hook_all_reduce": "see delay_all_reduce_named_params",
    "mixed_precision": "compute in low precision with torch.autocast, and reduce in fp16/bf16 "
                       "with register_comm_hook(None, tandem.parallel.comm_hooks.fp16_compress_"
                       "hook) (or bf16_compress_hook)",
    "device_mesh": "pass process_group= (a tandem group) instead",
    "bucket_cap_mb_list": "give one size for every bucket with bucket_cap_mb",
    "skip_all_reduce_unused_params": "tandem reduces every bucket whole, unused parameters' "
                                     "zeros included",
}


def _refuse_sparse_gradients(module: nn.Module, ignored: set[str]) -> None:
    """Refuse embeddings built with ``sparse=True``: their gradients are sparse tensors,
    which tandem's collectives do not reduce (the user would otherwise meet an error
    about ``all_reduce_coalesced`` in the middle of the first backward)."""
    for prefix, m in module.named_modules():
        if not isinstance(m, (nn.Embedding, nn.EmbeddingBag)) or not m.sparse:
            continue
        name = f"{prefix}.weight" if prefix else "weight"
        if name in ignored or not m.weight.requires_grad:
            continue
        where = f"'{prefix}'" if prefix else "the module"
        raise ArgumentError(
            f"DistributedDataParallel: {where} is an {type(m).__name__} with sparse=True, so '{name}' would get a sparse gradient, "
            f"which tandem does not reduce; build it with sparse=False (then train it with "
            f"a dense optimizer), or leave it out of DDP with "
            f"DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, "
            f"['{name}']) and keep it in sync yourself")


def _refuse_unsupported(**given: Any) -> None:
    """Refuse the arguments of DDP features tandem does not have, when they are set."""
    for name, value in given.items():
        if value is not None and value is not False:
            raise ArgumentError(f"DistributedDataParallel: {name}={value!r} is not supported "
                                f"by tandem; {_UNSUPPORTED[name]}")


def _buffer_sync(broadcast_buffers: bool | None,
                 forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """(sync buffers at construction, sync them before each training forward), from
    torch's two arguments: the older ``broadcast_buffers`` says both, the newer
    ``forward_sync_buffers`` only the second, and wins where both are given."""
    for name, value in (("broadcast_buffers", broadcast_buffers),
                        ("forward_sync_buffers", forward_sync_buffers)):
        if value is not None and (isinstance(value, str) or value not in (True, False)):
            raise ArgumentError(f"DistributedDataParallel: {name} must be True, False or "
                                f"None, got {value!r}")
    if (broadcast_buffers is not None and forward_sync_buffers is not None
            and broadcast_buffers != forward_sync_buffers):
        warnings.warn(f"DistributedDataParallel: broadcast_buffers={broadcast_buffers} and "
                      f"forward_sync_buffers={forward_sync_buffers} disagree: the forward "
                      f"follows forward_sync_buffers, the sync at construction "
                      f"broadcast_buffers", stacklevel=3)
    init = broadcast_buffers is None or bool(broadcast_buffers)
    forward = bool(forward_sync_buffers) if forward_sync_buffers is not None else init
    return init, forward


def _check_hook_takes_state_and_bucket(hook: Callable[..., Any]) -> None:
    """A hook is called as ``hook(state, bucket)``: one that cannot take those two failed
    with a TypeError inside the first backward, on its rank alone."""
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return  # a builtin without a signature: it will say so when called
    try:
        signature.bind(None, None)
    except TypeError as exc:
        raise ArgumentError(f"register_comm_hook: the hook is called as hook(state, bucket), "
                            f"but {getattr(hook, '__qualname__', hook)!r}{signature} cannot "
                            f"take those two arguments ({exc})") from None


class DistributedDataParallel(nn.Module, GroupJoinable):
    """Wrap ``module`` so that ``backward()`` averages its gradients over the group."""

    join_kwargs = frozenset({"divide_by_initial_world_size"})

    def __init__(self, module: nn.Module, device_ids: Any = None, output_device: Any = None,
                 dim: int = 0, broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group: ProcessGroup | NonMemberGroup | None = None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, delay_all_reduce_named_params: Any = None,
                 param_to_hook_all_reduce: Any = None, mixed_precision: Any = None,
                 device_mesh: Any = None, skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: Any = None, batched_grad_copy: bool = False,
                 forward_sync_buffers: bool | None = None) -> None:
        """torch's arguments, in torch's order. Buffers: ``forward_sync_buffers`` (None:
        True) says whether a training forward first copies rank 0's buffers to every
        rank; the older ``broadcast_buffers`` says it too when that is not given, and
        ``broadcast_buffers=False`` also keeps buffers out of the sync at construction.
        ``check_reduction`` does nothing, in torch as here; ``batched_grad_copy`` picks
        how torch copies gradients into its buckets, and tandem's own copy path gives the
        same result, so it is accepted and changes nothing. The arguments for features
        tandem does not have are refused when set (see :func:`_refuse_unsupported`)."""
        super().__init__()
        Joinable.__init__(self)
        if not isinstance(module, nn.Module):
            raise ArgumentError(f"DistributedDataParallel wraps an nn.Module, got "
                                f"{type(module).__name__}")
        if device_ids not in (None, [], ()) or output_device is not None:
            raise ArgumentError(
                f"DistributedDataParallel: device_ids={device_ids!r} and output_device="
                f"{output_device!r} must be None; tandem trains CPU modules")
        _refuse_unsupported(delay_all_reduce_named_params=delay_all_reduce_named_params,
                            param_to_hook_all_reduce=param_to_hook_all_reduce,
                            mixed_precision=mixed_precision, device_mesh=device_mesh,
                            bucket_cap_mb_list=bucket_cap_mb_list,
                            skip_all_reduce_unused_params=skip_all_reduce_unused_params)
        for name, flag in (("init_sync", init_sync), ("find_unused_parameters",
                           find_unused_parameters), ("check_reduction", check_reduction),
                           ("gradient_as_bucket_view", gradient_as_bucket_view),
                           ("static_graph", static_graph),
                           ("batched_grad_copy", batched_grad_copy)):
            if isinstance(flag, str) or flag not in (True, False):  # 0, 1, numpy bools pass
                raise ArgumentError(f"DistributedDataParallel: {name} must be True or False, "
                                    f"got {flag!r}")
        init_buffers, forward_buffers = _buffer_sync(broadcast_buffers, forward_sync_buffers)
        bucket_cap_mb = 25 if bucket_cap_mb is None else bucket_cap_mb
        if isinstance(bucket_cap_mb, (bool, str)) or not isinstance(bucket_cap_mb, (int, float)):
            raise ArgumentError(f"DistributedDataParallel: bucket_cap_mb must be a number of "
                                f"MiB, got {bucket_cap_mb!r}")
        if not bucket_cap_mb > 0:
            raise ArgumentError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        at_most("DistributedDataParallel: bucket_cap_mb", bucket_cap_mb, memory_limit() >> 20,
                f"MiB: no bucket can be larger than the {memory_text()}",
                "use the default (25) or a few hundred MiB at most")
        ignored = _ignored(module)
        _refuse_sparse_gradients(module, ignored)
        group = resolve_group(process_group, "DistributedDataParallel")
        named_params = [(n, p) for n, p in module.named_parameters() if n not in ignored]
        named_buffers = [(n, b) for n, b in module.named_buffers() if n not in ignored]
        for name, t in named_params + named_buffers:
            if t.device.type != "cpu":
                raise ArgumentError(f"DistributedDataParallel: '{name}' is on {t.device}; "
                                    f"tandem trains CPU modules")
        trained = [(n, p) for n, p in named_params if p.requires_grad]
        if not trained:
            raise ArgumentError("DistributedDataParallel: the module has no parameter that "
                                "requires a gradient, so there is nothing to synchronise")

        self.module = module
        self.process_group = group
        self.device_ids = None
        self.output_device = None
        self.dim = dim
        self.broadcast_buffers = forward_buffers  # what a forward does (torch's attribute)
        self.forward_sync_buffers = forward_buffers
        self.batched_grad_copy = batched_grad_copy
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.bucket_bytes_cap = int(bucket_cap_mb * 1024 * 1024)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.stats = DDPStats()
        self._comm_hook_set = False
        self._divide_by_initial_world_size = True
        self._synced_params = [p for _, p in named_params]

        if init_sync:
            verify_same_model(group, describe_module(named_params, named_buffers))
            states = [p.detach() for _, p in named_params]
            if init_buffers:  # as torch: buffers stay per rank otherwise
                states += [b for _, b in named_buffers]
            with torch.no_grad():
                broadcast_tensors(group, states)
        self._buffers_sync = BufferBroadcaster(group, [b for _, b in named_buffers])
        self.reducer = Reducer(
            [n for n, _ in trained], [p for _, p in trained], group,
            bucket_cap_bytes=self.bucket_bytes_cap,
            first_bucket_bytes=min(FIRST_BUCKET_BYTES, self.bucket_bytes_cap),
            gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=find_unused_parameters, static_graph=static_graph,
            stats=self.stats)

    # -- forward -----------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        self.reducer.check_idle()
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        self.require_forward_param_sync = sync
        buffers = (sync and self.training and self.broadcast_buffers
                   and bool(self._buffers_sync.buffers))
        if self._join_config.enable:
            Join.notify_join_context(self)
            flags = TRAINING | (SYNC if sync else 0) | (BUFFERS if buffers else 0)
            _, self.reducer.divisor = self._join_round(flags)
        elif buffers:
            self._buffers_sync()
        output = self.module(*inputs, **kwargs)
        self.reducer.prepare(output, sync)
        t1 = time.perf_counter()
        self.stats.pending_forward_s = t1 - t0
        timeline = self.process_group.recorder.timeline  # [timeline hook]
        if timeline is not None:
            timeline.span("DDP forward", t0, t1, "ddp")
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this block, backward accumulates gradients locally without communicating.

        The first synchronised backward after it averages the accumulated sums.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # -- uneven inputs ---------------------------------------------------------------------
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """``with ddp.join():`` lets ranks leave the training loop at different iterations.

        ``divide_by_initial_world_size=False`` averages over the ranks still training
        instead of the whole group; see :class:`~tandem.algorithms.join.Join`.
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a joined rank runs (``divide_by_initial_world_size``, default True)."""
        self._divide_by_initial_world_size = flag_argument(
            "DistributedDataParallel.join: divide_by_initial_world_size",
            kwargs.get("divide_by_initial_world_size", True))
        return DDPJoinHook(self, self._join_round, self._replica)

    def _join_round(self, mine: int) -> tuple[int, int | None]:
        return join_round(self.process_group, self._buffers_sync,
                          self._divide_by_initial_world_size, mine)

    def _replica(self) -> list[torch.Tensor]:
        """What the last rank to join copies to the others when all have joined."""
        tensors = [p.detach() for p in self._synced_params]
        if self.broadcast_buffers:
            tensors += self._buffers_sync.buffers
        return tensors

    # -- communication hooks -------------------------------------------------------------
    def register_comm_hook(self, state: object,
                           hook: Callable[[Any, GradBucket], torch.futures.Future[Any]]) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future[Tensor]`` instead of AVG.

        Call once, before the first backward. See ``tandem.parallel.comm_hooks``.
        """
        if not callable(hook):
            raise ArgumentError("register_comm_hook: hook must be callable")
        _check_hook_takes_state_and_bucket(hook)
        if self._comm_hook_set:
            raise StateError("register_comm_hook can only be called once")
        if self.backward_started:
            raise StateError("register_comm_hook must be called before the first backward")
        reduce: Callable[[Any, GradBucket], torch.futures.Future[Any]] | None = hook
        if isinstance(hook, ObservingHook):  # e.g. tandem.optim.hook_with_zero_step
            hook.attach(self)
            reduce = hook.hook
            if reduce is allreduce_hook and state in (None, self.process_group):
                reduce = None  # the built-in average: same result, in place where it can
        if reduce is not None and self.reducer.shards is not None:
            raise ArgumentError(
                "register_comm_hook: this DDP's gradients are sharded (shard_gradients), and "
                "sharding reduce-scatters the buckets itself; a hook that reduces whole "
                "buckets cannot be combined with it")
        self._comm_hook_set = True
        if isinstance(hook, ObservingHook):
            self.reducer.observer = hook
        if reduce is not None:
            self.reducer.hook = reduce
            self.reducer.hook_state = state

    @property
    def backward_started(self) -> bool:
        """True once a synchronising backward through this DDP has begun (one is under way,
        or one has finished). Comm hooks, ``hook_with_zero_step`` and ``shard_gradients``
        must be set before that."""
        return self.stats.steps > 0 or self.reducer.reducing

    def regroup(self, new_group: ProcessGroup) -> None:
        """Go on training on ``new_group``: later backwards average over its ranks.

        For a membership that changed while the processes live on (``tandem.elastic``
        calls it on every survivor and joiner after a lost rank or a scale-up, with the
        new default group). Call it on every member of ``new_group``, between steps; a
        backward that failed half-way on the old group (a rank was lost) is dropped with
        the old group's buckets.

        The gradient buckets and the buffer broadcaster are rebuilt on ``new_group``
        with this DDP's settings; the buckets keep their layout. Parameters and buffers
        are not synchronised: make them equal on every member first (elastic restores
        the same commit everywhere, or sends it to joiners). A comm hook registered with
        state None or the old group moves along, its state becoming ``new_group``.

        Raises :class:`~tandem.errors.ArgumentError` if ``new_group`` is not a process
        group this rank belongs to, and :class:`~tandem.errors.StateError` when the DDP
        carries something bound to the old group: sharded gradients
        (``shard_gradients``), an observing hook (``hook_with_zero_step``) or a comm hook
        with a state of its own.
        """
        if not isinstance(new_group, ProcessGroup):
            what = ("a group this rank is not a member of" if isinstance(new_group, NonMemberGroup)
                    else type(new_group).__name__)
            raise ArgumentError(f"DistributedDataParallel.regroup: new_group must be a "
                                f"ProcessGroup holding this rank, got {what}")
        old = self.reducer
        why = ("sharded gradients" if old.shards is not None else
               "an observing comm hook (hook_with_zero_step)" if old.observer is not None else
               "a comm hook with a state of its own" if old.hook is not None
               and old.hook_state not in (None, self.process_group) else "")
        if why:
            raise StateError(f"DistributedDataParallel cannot move to a new process group "
                             f"with {why}")
        hook, moves = old.hook, old.hook_state is self.process_group
        old.close()
        self.process_group = new_group
        self._buffers_sync = BufferBroadcaster(new_group, self._buffers_sync.buffers)
        self.reducer = Reducer(
            old.names, old.params, new_group, bucket_cap_bytes=old.bucket_cap_bytes,
            first_bucket_bytes=old.first_bucket_bytes, gradient_as_bucket_view=old.view_mode,
            find_unused_parameters=old.find_unused, static_graph=self.static_graph,
            stats=self.stats)
        if hook is not None:
            self.reducer.hook = hook
            self.reducer.hook_state = new_group if moves else None

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module,
                                                    params_and_buffers_to_ignore: Any) -> None:
        """torch's way of leaving parameters and buffers out of DDP (their fully qualified
        names, as ``named_parameters`` gives them): call it before wrapping ``module``."""
        if isinstance(params_and_buffers_to_ignore, str):
            raise ArgumentError("_set_params_and_buffers_to_ignore_for_model: give a list of "
                                f"names, not the string {params_and_buffers_to_ignore!r}")
        # the attribute torch's DDP reads too (see _ignored)
        setattr(module, "_ddp_params_and_buffers_to_ignore", list(params_and_buffers_to_ignore))

    def _set_static_graph(self) -> None:
        self.static_graph = True
        self.reducer.static_graph = True

    def extra_repr(self) -> str:
        g = self.process_group
        return (f"group='{g.group_name}' rank={g.group_rank}/{g.group_size}, "
                f"buckets={len(self.reducer.buckets)}, "
                f"find_unused_parameters={self.find_unused_parameters}, "
                f"gradient_as_bucket_view={self.gradient_as_bucket_view}")
