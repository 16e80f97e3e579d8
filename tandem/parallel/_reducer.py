"""The reducer: gradients into buckets, buckets onto the wire, results back into ``.grad``.

One backward pass, as the reducer sees it:

1. ``prepare(outputs)`` after a synchronising forward: remember that hooks are
   expected, and (``find_unused_parameters``) walk the autograd graph from the
   outputs to find the parameters that cannot receive a gradient.
2. Each parameter's post-accumulate-grad hook copies its gradient into its bucket
   (or, with ``gradient_as_bucket_view``, makes ``.grad`` a view of the bucket). The
   first hook of the pass queues :meth:`_finalize` to run when the autograd engine
   finishes, and marks the unused parameters ready.
3. When every gradient of a bucket is in, the bucket's all-reduce (AVG, in pieces
   of at most 4 MiB, see :meth:`Reducer._pieces`) is issued asynchronously, so it
   overlaps the rest of backward; the last bucket is reduced in the backward thread
   itself. Buckets are issued strictly in bucket order, on every rank, whatever
   order the gradients arrive in: the collective layer matches calls by sequence
   number.
4. ``_finalize`` (still inside ``loss.backward()``) waits for every bucket and writes
   the averaged gradients back.

Communication hooks run one bucket at a time: a bucket's hook starts when the
previous bucket's future has completed (from the thread that completed it). A
hook may issue several collectives in a chain (PowerSGD does); serialising the
hooks is what keeps every rank's sequence of collectives identical.

Two attachments change step 3 and 4: gradient sharding (``_shard.GradShards``)
reduce-scatters each bucket so that a rank keeps only the gradients it optimises, and
an observer (``_observer.GradObserver``) hears about each bucket as ``_finalize``
writes it back. A joined rank (``tandem.algorithms.join``) runs the same reductions
with zero gradients in :meth:`Reducer.shadow_backward`; ``divisor`` makes them
average over the ranks still training instead of the whole group.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Sequence

import torch

from tandem.collectives.api import all_reduce, all_reduce_coalesced
from tandem.collectives.group import ProcessGroup, spans_hosts
from tandem.collectives.reduce_op import ReduceOp
from tandem.errors import ArgumentError, StateError
from tandem.parallel._buckets import Bucket, GradBucket, assign_buckets
from tandem.parallel._ddp_stats import DDPStats, step_times
from tandem.parallel._graph import find_tensors, reachable_parameters
from tandem.parallel._observer import GradObserver
from tandem.parallel._shard import GradShards

__all__ = ["Reducer"]

Hook = Callable[[Any, GradBucket], torch.futures.Future[Any]]
_clock = time.perf_counter
MAX_MESSAGE_BYTES = 4 << 20  # see Reducer._pieces and message_cap
SHARDED_BUCKET_BYTES = 4 << 20  # see Reducer.shard


def _is_view_of(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return (grad.data_ptr() == view.data_ptr() and grad.shape == view.shape
            and grad.stride() == view.stride() and grad.dtype == view.dtype)


class Reducer:
    """Owns the buckets of one DDP instance and the per-backward state machine."""

    def __init__(self, names: Sequence[str], params: Sequence[torch.nn.Parameter],
                 group: ProcessGroup, *, bucket_cap_bytes: int, first_bucket_bytes: int,
                 gradient_as_bucket_view: bool, find_unused_parameters: bool,
                 static_graph: bool, stats: DDPStats) -> None:
        self.names = list(names)
        self.params = list(params)
        self.group = group
        self.view_mode = gradient_as_bucket_view
        self.find_unused = find_unused_parameters
        self.static_graph = static_graph
        self.stats = stats
        self.bucket_cap_bytes = bucket_cap_bytes
        self.first_bucket_bytes = first_bucket_bytes
        layout = assign_buckets(self.params, bucket_cap_bytes, first_bucket_bytes)
        self.buckets = [Bucket(i, members, self.params) for i, members in enumerate(layout)]
        self.where: list[tuple[Bucket, int]] = [None] * len(self.params)  # type: ignore[list-item]
        for b in self.buckets:
            for pos, i in enumerate(b.members):
                self.where[i] = (b, pos)
        self.hook: Hook | None = None
        self.hook_state: Any = None
        self.unused_error_aborts = True
        self.max_message_bytes = message_cap(group)
        self.shards: GradShards | None = None
        self.observer: GradObserver | None = None
        self.divisor: int | None = None  # average over this many ranks (Join), not all

        n = len(self.params)
        self._expect = False       # a synchronising forward ran; its backward reduces
        self._started = False      # the first hook of that backward has fired
        self._ready = [False] * n
        self._next = 0             # first bucket not yet issued
        self._local_used = [False] * n  # hooks fired since the last sync (no_sync included)
        self._predicted_unused: list[int] = []
        self._static_unused: list[int] | None = None
        self._static_global_unused: set[int] | None = None
        self._used_map: torch.Tensor | None = None
        self._used_future: torch.futures.Future[Any] | None = None
        self._tail: torch.futures.Future[Any] | None = None
        self._t_backward = 0.0
        self._inline = (0.0, 0.0)  # when backward was blocked reducing the last bucket
        self._direct = False       # this backward reduces gradients where they are

        if self.view_mode:
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    if p.grad is not None:
                        b, pos = self.where[i]
                        b.views[pos].copy_(p.grad)
                        p.grad = b.views[pos]

        ref = weakref.ref(self)

        def make_hook(i: int) -> Callable[[torch.Tensor], None]:
            def hook(_: torch.Tensor) -> None:
                reducer = ref()
                if reducer is not None:
                    reducer._on_grad(i)
            return hook

        handles = [p.register_post_accumulate_grad_hook(make_hook(i))
                   for i, p in enumerate(self.params)]
        self._finalizer = weakref.finalize(self, _remove_handles, handles)

    # -- called by DistributedDataParallel -------------------------------------------
    @property
    def reducing(self) -> bool:
        """A synchronising backward is under way: its first gradient hook has fired and
        its buckets are not all reduced yet."""
        return self._started

    def check_idle(self) -> None:
        if self._started:
            raise StateError(
                "DistributedDataParallel: the previous backward pass started gradient "
                "synchronisation but never finished it (did backward raise?); the ranks "
                "may be out of step, so training cannot continue on this process group")

    def prepare(self, outputs: Any, sync: bool) -> None:
        """After forward: expect hooks (``sync``) and predict unused parameters."""
        self._expect = sync
        if not sync:
            return
        self._t_backward = 0.0
        tensors = [t for t in find_tensors(outputs) if t.requires_grad]
        if self.static_graph and self._static_unused is not None:
            self._predicted_unused = self._static_unused
        elif self.find_unused or self.static_graph:
            reach = reachable_parameters(tensors)
            self._predicted_unused = [i for i, p in enumerate(self.params)
                                      if id(p) not in reach]
            if self.static_graph:
                self._static_unused = self._predicted_unused
        ref = weakref.ref(self)

        def note_start(*_: Any) -> None:
            reducer = ref()
            if reducer is not None and reducer._t_backward == 0.0:
                reducer._t_backward = _clock()

        for t in tensors:
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(note_start)

    def close(self) -> None:
        self._finalizer()
        if self.shards is not None:
            self.shards.close()

    def shard(self, owners: Sequence[int]) -> None:
        """Reduce-scatter from now on: ``owners[i]`` is the group rank that keeps the
        gradient of parameter ``i`` (see ``_shard``). Before the first backward.

        Gradients stay alive until their bucket is reduced, so sharded buckets are cut
        at :data:`SHARDED_BUCKET_BYTES` (or the smaller cap DDP was given): the
        gradients in flight then stay a small part of the 1/N kept.
        """
        if self.shards is not None:
            self.shards.close()
        self.shards = GradShards(self.params, owners, self.group)
        cap = min(self.bucket_cap_bytes, SHARDED_BUCKET_BYTES)
        layout = assign_buckets(self.params, cap, min(self.first_bucket_bytes, cap))
        self.buckets = [Bucket(i, self.shards.order(members), self.params)
                        for i, members in enumerate(layout)]
        self.shards.lay_out(self.buckets)
        for b in self.buckets:
            for pos, i in enumerate(b.members):
                self.where[i] = (b, pos)

    def shadow_backward(self, divisor: int | None) -> None:
        """On a joined rank: take part in one backward's reductions with zero gradients.

        The averages of the ranks still training land in ``.grad`` (so a sharded
        optimizer steps its shard with them), and the observer runs as usual.
        """
        self.check_idle()
        self.divisor = divisor
        self._expect = True
        self._predicted_unused = []
        if self.shards is not None:
            self.shards.forget()
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad.zero_()
        self._begin(in_backward=False)
        try:
            for i in reversed(range(len(self.params))):  # backward's order
                self._mark_ready(i)
            self._finalize(record=False)
        finally:
            self._reset()

    # -- the backward pass -------------------------------------------------------------
    def _on_grad(self, i: int) -> None:
        self._local_used[i] = True
        if not self._expect:
            return
        if not self._started:
            self._begin(in_backward=True)
        if self._ready[i] and i in self._predicted_unused:
            raise StateError(
                f"DistributedDataParallel: parameter '{self.names[i]}' received a gradient "
                f"although it was not reachable from the outputs of forward(), so its bucket "
                f"was already reduced without it. Use the parameter only inside the wrapped "
                f"module's forward.")
        self._mark_ready(i)

    def _begin(self, in_backward: bool) -> None:
        self._started = True
        # same-host groups reduce .grad tensors in place through shared memory: no bucket
        # buffer, no copies in and out of it (hooks, views, unused parameters and
        # sharding need the buckets, so they keep them)
        self._direct = (self.hook is None and not self.view_mode and not self.find_unused
                        and not self.static_graph and self.shards is None
                        and self.group.shares_memory)
        if self._t_backward == 0.0:
            self._t_backward = _clock()
        if in_backward:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_callback)
        for i in self._predicted_unused:
            if not self._ready[i]:
                self._mark_ready(i)

    def _mark_ready(self, i: int) -> None:
        if self._ready[i]:
            raise StateError(
                f"DistributedDataParallel: parameter '{self.names[i]}' received its gradient "
                f"twice in one backward pass (reentrant checkpointing, or a parameter shared "
                f"outside the module?); this is not supported")
        self._ready[i] = True
        b, pos = self.where[i]
        p = self.params[i]
        g = p.grad
        if self._direct or self.shards is not None:  # no bucket buffer: .grad is reduced
            if g is None:  # it contributes zeros, as its bucket slot would
                p.grad = torch.zeros_like(p)
            b.pending -= 1
            if b.pending == 0:
                self._issue_ready_buckets()
            return
        view = b.views[pos]
        with torch.no_grad():
            if g is None:
                view.zero_()
            elif self.view_mode:
                if not _is_view_of(g, view):
                    view.copy_(g)
                    p.grad = view
            else:
                view.copy_(g)
        b.pending -= 1
        if b.pending == 0:
            self._issue_ready_buckets()

    def _issue_ready_buckets(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._issue(self.buckets[self._next])
            self._next += 1
            if self._next == len(self.buckets) and self._needs_used_map():
                self._issue_used_map()

    def _issue(self, b: Bucket) -> None:
        b.t_launch = _clock()
        last = b.index == len(self.buckets) - 1
        if self.hook is not None:
            grad_bucket = GradBucket(b, self.params, last)
            hook, state = self.hook, self.hook_state
            fut = self._chain(lambda: hook(state, grad_bucket))
        elif self.shards is not None:
            fut = self.shards.issue(b, inline=last and not self._needs_used_map())
            if fut.done():
                self._inline = (b.t_launch, _clock())
        elif self._direct:
            # every member has a .grad by now (see _mark_ready)
            grads = [g for i in b.members if (g := self.params[i].grad) is not None]
            work = all_reduce_coalesced(grads, op=ReduceOp.AVG, group=self.group,
                                        async_op=not last)
            if last:  # in this thread, as below
                self._inline = (b.t_launch, _clock())
                fut = torch.futures.Future()
                fut.set_result(None)
            else:
                assert work is not None
                fut = work.get_future()
        elif last and not self._needs_used_map():
            # backward is (all but) over and _finalize is about to wait for it: run the
            # last bucket in this thread, which saves a hand-off to the progress thread
            # when it is idle (measured: ~0.3 ms per step on 2 ranks)
            for piece in self._pieces(b):
                all_reduce(piece, op=ReduceOp.AVG, group=self.group)
            self._inline = (b.t_launch, _clock())
            fut = torch.futures.Future()
            fut.set_result([b.buffer])
        else:
            fut = self._average_async(b)

        def done(_: torch.futures.Future[Any], b: Bucket = b) -> None:
            b.t_done = _clock()

        fut.add_done_callback(done)
        b.future = fut

    def _average_async(self, b: Bucket) -> torch.futures.Future[Any]:
        futures = []
        for piece in self._pieces(b):
            work = all_reduce(piece, op=ReduceOp.AVG, group=self.group, async_op=True)
            assert work is not None
            futures.append(work.get_future())
        if len(futures) == 1:
            return futures[0]

        def whole(all_done: torch.futures.Future[Any]) -> list[torch.Tensor]:
            for f in all_done.value():
                f.value()  # re-raises the first piece's error
            return [b.buffer]

        return torch.futures.collect_all(futures).then(whole)

    def _pieces(self, b: Bucket) -> list[torch.Tensor]:
        """The bucket as contiguous views of at most ``max_message_bytes`` each.

        Each all-reduce allocates scratch space as large as its input (the ring's
        receive buffers), so reducing a 25 MB bucket in 4 MB pieces lowers the peak
        memory of a step by ~20 MB; the pieces queue back to back on the progress
        thread, so the wire stays busy (measured on the 8 x 1024^2 MLP, 2 ranks).
        Across hosts the bucket goes whole (see :func:`message_cap`).
        """
        if self.max_message_bytes is None:
            return [b.buffer]
        step = max(1, self.max_message_bytes // b.buffer.element_size())
        n = b.buffer.numel()
        return [b.buffer[i:i + step] for i in range(0, n, step)] if n > step else [b.buffer]

    def _chain(self, start: Callable[[], torch.futures.Future[Any]]) -> torch.futures.Future[Any]:
        """Run ``start()`` once every earlier chained future has completed."""
        out: torch.futures.Future[Any] = torch.futures.Future()

        def forward_result(f: torch.futures.Future[Any]) -> None:
            try:
                out.set_result(f.value())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                out.set_exception(exc)

        def run(_: Any = None) -> None:
            try:
                fut = start()
                if not isinstance(fut, torch._C.Future):  # .then() returns the base class
                    raise ArgumentError(f"a DDP communication hook must return a "
                                        f"torch.futures.Future[Any], got {type(fut).__name__}")
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                out.set_exception(exc)
                return
            fut.add_done_callback(forward_result)

        prev, self._tail = self._tail, out
        if prev is None:
            run()
        else:
            prev.add_done_callback(run)
        return out

    def _needs_used_map(self) -> bool:
        if self.static_graph:
            return self._static_global_unused is None
        return self.find_unused

    def _issue_used_map(self) -> None:
        self._used_map = torch.tensor(self._local_used, dtype=torch.uint8)
        used = self._used_map

        def reduce_used() -> torch.futures.Future[Any]:
            work = all_reduce(used, op=ReduceOp.MAX, group=self.group, async_op=True)
            assert work is not None
            return work.get_future()

        self._used_future = reduce_used() if self.hook is None else self._chain(reduce_used)

    def _finalize_callback(self) -> None:
        try:
            self._finalize()
        finally:
            self._reset()

    def _finalize(self, record: bool = True) -> None:
        t_compute_end = _clock()
        missing = [i for i, ready in enumerate(self._ready) if not ready]
        if missing:
            if not (self.find_unused or self.static_graph):
                raise self._unused_error(missing)
            for i in missing:
                self._mark_ready(i)
        assert self._next == len(self.buckets)
        t0 = _clock()
        global_unused = self._global_unused()
        if self.hook is not None and self.observer is not None:
            # hooks issue their collectives from future callbacks: let them all be issued
            # before the observer issues any, so every rank issues them in one order
            for b in self.buckets:
                assert b.future is not None
                b.future.wait()
        waited = _clock() - t0
        factor = None if self.divisor is None else self.group.group_size / self.divisor
        observed = 0.0
        for b in self.buckets:
            assert b.future is not None
            t0 = _clock()
            value = b.future.wait()
            waited += _clock() - t0
            b.result = value[0] if isinstance(value, (list, tuple)) and value else value
            if self.shards is not None:
                self.shards.write_back(b, global_unused, factor)
            elif not self._direct:
                self._write_back(b, global_unused, factor)
            elif factor is not None:
                with torch.no_grad():
                    for i in b.members:
                        self.params[i].grad.mul_(factor)  # type: ignore[union-attr]
            if self.observer is not None:
                t0 = _clock()
                self.observer.bucket_reduced(b.index, [self.params[i] for i in b.members])
                observed += _clock() - t0
        if self.shards is not None:
            self.shards.done()
        if self.observer is not None:
            t0 = _clock()
            self.observer.backward_done()
            observed += _clock() - t0
        t_end = _clock()
        if record:
            self._record(t_compute_end, t_compute_end + waited, t_end - observed)

    def _global_unused(self) -> set[int]:
        """Parameters no rank produced a gradient for (find_unused / static_graph)."""
        global_unused: set[int] = set()
        if self._used_future is not None:
            self._used_future.wait()
            assert self._used_map is not None
            global_unused = {i for i, u in enumerate(self._used_map.tolist()) if not u}
            if self.static_graph:
                self._static_global_unused = global_unused
        elif self.static_graph and self._static_global_unused is not None:
            global_unused = self._static_global_unused
        return global_unused

    def _write_back(self, b: Bucket, global_unused: set[int], factor: float | None) -> None:
        with torch.no_grad():
            res = b.result
            if not isinstance(res, torch.Tensor):
                raise ArgumentError(f"the communication hook's future for bucket {b.index} "
                                    f"returned {type(res).__name__}, not a tensor")
            if res.data_ptr() != b.buffer.data_ptr():
                if res.numel() != b.buffer.numel():
                    raise ArgumentError(
                        f"the communication hook returned {res.numel()} elements for "
                        f"bucket {b.index}, which holds {b.buffer.numel()}")
                b.buffer.copy_(res.reshape(-1))
            if factor is not None:
                b.buffer.mul_(factor)
            for pos, i in enumerate(b.members):
                if i in global_unused:
                    continue  # no rank produced a gradient: leave .grad as it is
                p, view = self.params[i], b.views[pos]
                if self.view_mode:
                    if p.grad is None or not _is_view_of(p.grad, view):
                        p.grad = view
                elif p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)

    def _record(self, t_compute_end: float, t_waited: float, t_end: float) -> None:
        self.stats.record(step_times(
            [(b.t_launch, b.t_done or t_waited) for b in self.buckets], self._inline,
            self.stats.pending_forward_s, self._t_backward, t_compute_end, t_waited, t_end,
            sum(b.nbytes for b in self.buckets)))
        timeline = self.group.recorder.timeline  # [timeline hook] buckets against backward
        if timeline is not None:
            timeline.ddp_backward(self._t_backward, t_compute_end, t_waited, t_end,
                                  [(b.index, b.nbytes, b.t_launch, b.t_done or t_waited)
                                   for b in self.buckets])

    def _unused_error(self, missing: list[int]) -> StateError:
        names = [self.names[i] for i in missing]
        shown = ", ".join(repr(n) for n in names[:10]) + (" ..." if len(names) > 10 else "")
        error = StateError(
            f"DistributedDataParallel on rank {self.group.ranks[self.group.group_rank]}: "
            f"{len(names)} "
            f"parameter(s) received no gradient in this backward pass: {shown}. Their buckets "
            f"can never be reduced. Make every parameter contribute to the loss, pass "
            f"find_unused_parameters=True, or set requires_grad=False on parameters that are "
            f"not trained. The process group was aborted so that no rank waits for the "
            f"missing gradients.")
        if self.unused_error_aborts:
            # peers that did get these gradients are (or will be) waiting on buckets this
            # rank will never issue; aborting makes them raise this message at once
            self.group.abort(error)  # type: ignore[arg-type, unused-ignore]
        return error

    def _reset(self) -> None:
        self._expect = False
        self._started = False
        self._ready = [False] * len(self.params)
        self._next = 0
        self._tail = None
        self._used_map = None
        self._used_future = None
        self._inline = (0.0, 0.0)
        self._direct = False
        self.divisor = None
        for b in self.buckets:
            b.reset()
        self._local_used = [False] * len(self.params)


def message_cap(group: ProcessGroup) -> int | None:
    """The most bytes one all-reduce of a bucket carries; None: the whole bucket.

    Within a host, 4 MiB pieces (see ``Reducer._pieces``). Across hosts the link is
    the bottleneck, and every message pays for filling and draining the pipeline of
    the hosts' leaders (the first chunk crosses the link before the first reduced
    chunk can come back) once more: on 2 x 2 simulated hosts at 1 Gbit/s a 4 MiB
    all-reduce ran at ~80% of the link bound, and the 8 x 1024^2 MLP stepped in
    380-390 ms with 4 MiB pieces, 378 ms with 16 MiB ones and 365 ms with whole
    buckets (torch: 487-505 ms), for ~34 MiB more peak memory on the leaders.
    """
    return None if spans_hosts(group) else MAX_MESSAGE_BYTES


def _remove_handles(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
