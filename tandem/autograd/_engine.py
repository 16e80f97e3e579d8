"""The distributed backward pass ("FAST mode"): each worker's part runs as its gradients arrive.

    with tandem.autograd.context() as ctx:
        loss = model(batch)                   # RPCs inside record send/recv points
        tandem.autograd.backward(ctx, [loss])
        grads = tandem.autograd.get_gradients(ctx)   # {tensor: gradient}, this worker's

One *pass* runs torch's local autograd from some outputs with their gradients, down to
the leaves. Leaves that arrived in a message of the context get their gradients sent
back to the sender, whose pass then starts from what it sent (its send point). Every
other leaf's gradient accumulates in the context, never in ``.grad``. Because backward
is linear, running one pass per arriving gradient sums to the same gradients as one
big pass; a part of a graph reached twice needs ``retain_graph=True`` (the error says so).

Leaf ``.grad`` serves as the pass's scratch (saved and restored around it, passes of a
worker one at a time), so that post-accumulate-grad hooks run: that is how DDP on the
local part of a model reduces its gradients inside a distributed backward.

Completion: each gradient message is an ``async_execution`` call whose reply waits for
the passes it caused downstream, so ``backward`` returns when the whole tree is done and
raises the first error of any worker.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch

from tandem.autograd._context import Context
from tandem.config import flag_argument
from tandem.errors import ArgumentError, StateError
from tandem.parallel._graph import reachable_leaves
from tandem.rpc import _state
from tandem.rpc.functions import async_execution

__all__ = ["context", "backward", "get_gradients"]

_PASS = threading.Lock()  # one pass at a time per process: leaf .grad is their scratch


class context:  # noqa: N801 - torch's name
    """``with context() as context_id:`` — a distributed autograd context for this thread;
    released on every worker that took part when the block exits."""

    def __enter__(self) -> int:
        agent = _state.require("tandem.autograd.context")
        self._ctx = agent.autograd.create()
        self._previous = agent.autograd.enter(self._ctx.id)
        return self._ctx.id

    def __exit__(self, *exc: object) -> None:
        agent = _state.current()
        if agent is None:
            return
        agent.autograd.leave(self._previous)
        agent.autograd.release(self._ctx.id, agent.notify)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """The gradients this worker accumulated in ``context_id``: {leaf tensor: gradient}."""
    ctx = _state.require("get_gradients").autograd.require(context_id, "get_gradients")
    with ctx.lock:
        return dict(ctx.grads)


def _surrogate(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """A scalar whose gradient with respect to each output is its given gradient, exactly
    (``sum(out * grad)``). Backward from it passes no gradient tensors to torch, whose
    check of their shapes costs a second per process on first use (it imports sympy)."""
    total: torch.Tensor | None = None
    for out, grad in pairs:
        if out.is_complex():
            out, grad = torch.view_as_real(out), torch.view_as_real(grad)
        term = (out * grad).sum()
        total = term if total is None else total + term
    assert total is not None
    return total


def _run_pass(ctx: Context, outputs: Sequence[torch.Tensor],
              grads: Sequence[torch.Tensor | None], retain_graph: bool) -> list[Any]:
    """One local pass; returns the futures of the gradient messages it sent."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    if not pairs:
        return []
    outs = [o for o, _ in pairs]
    leaves = reachable_leaves(outs)  # every output requires grad here
    if not leaves:
        return []
    with _PASS:
        saved = [leaf.grad for leaf in leaves]
        for leaf in leaves:
            leaf.grad = None
        try:
            _surrogate(pairs).backward(retain_graph=retain_graph)
            got = [leaf.grad for leaf in leaves]
        except RuntimeError as exc:
            if "second time" in str(exc):
                raise StateError(
                    f"distributed backward in context {ctx.id}: part of the graph on this "
                    f"worker is reached by gradients from several RPCs (or a second "
                    f"backward), and its buffers were freed by the first; pass "
                    f"retain_graph=True") from exc
            raise
        finally:
            for leaf, old in zip(leaves, saved):
                leaf.grad = old
    outgoing: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
    for leaf, g in zip(leaves, got):
        if g is None:
            continue
        where = ctx.recv_of(leaf)
        if where is None:
            ctx.accumulate(leaf, g)
        else:
            src, msg, index = where
            outgoing.setdefault((src, msg), {})[index] = g
    return [_send_grads(ctx, src, msg, by_index, retain_graph)
            for (src, msg), by_index in outgoing.items()]


def _send_grads(ctx: Context, src: int, msg: int, by_index: dict[int, torch.Tensor],
                retain_graph: bool) -> Any:
    agent = _state.require("tandem.autograd.backward")
    size = ctx.recv_sizes[(src, msg)]
    grads = [by_index.get(i) for i in range(size)]
    previous = agent.autograd.enter(0)  # gradients are data, not part of the context's graph
    try:
        _, call = agent.start(src, _apply_grads, (ctx.id, msg, grads, retain_graph), None, -1.0,
                              future=True, kind="backward")
    finally:
        agent.autograd.leave(previous)
    return call


def _all_done(futures: list[Any]) -> torch.futures.Future[Any]:
    """A future completed when all ``futures`` are, with the first error if any failed
    (the error keeps its class, unlike a ``then`` callback's)."""
    done: torch.futures.Future[Any] = torch.futures.Future()
    if not futures:
        done.set_result(None)
        return done
    lock = threading.Lock()
    state: dict[str, Any] = {"left": len(futures), "error": None}

    def one(f: torch.futures.Future[Any]) -> None:
        try:
            f.wait()
        except BaseException as exc:  # noqa: BLE001 - the first one is reported
            with lock:
                state["error"] = state["error"] or exc
        with lock:
            state["left"] -= 1
            last = state["left"] == 0
        if last:
            if state["error"] is not None:
                done.set_exception(state["error"])
            else:
                done.set_result(None)

    for f in futures:
        f.add_done_callback(one)
    return done


@async_execution
def _apply_grads(context_id: int, msg: int, grads: list[torch.Tensor | None],
                 retain_graph: bool) -> torch.futures.Future[Any]:
    """On the sender of message ``msg``: continue the backward pass from its send point."""
    agent = _state.require("tandem.autograd.backward")
    ctx = agent.autograd.require(context_id, f"backward (worker {agent.rank})")
    sent = ctx.sends.get(msg)
    if sent is None or len(sent) != len(grads):
        raise StateError(f"backward: context {context_id} on worker {agent.rank} has no record "
                         f"of message {msg} with {len(grads)} tensors requiring grad")
    return _all_done(_run_pass(ctx, sent, grads, retain_graph))


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the distributed backward pass from ``roots`` (scalar tensors) in ``context_id``;
    returns when every worker's part is done."""
    retain_graph = flag_argument("backward: retain_graph", retain_graph)  # "no": a TypeError
    agent = _state.require("tandem.autograd.backward")
    ctx = agent.autograd.require(context_id, "backward")
    if isinstance(roots, torch.Tensor):
        roots = [roots]
    if not roots or not all(isinstance(r, torch.Tensor) for r in roots):
        raise ArgumentError(f"backward: roots must be a non-empty list of tensors, got {roots!r}")
    for r in roots:
        if r.numel() != 1:
            raise ArgumentError(f"backward: every root must be a scalar, got shape "
                                f"{tuple(r.shape)}")
        if not r.requires_grad:
            raise ArgumentError("backward: a root does not require grad (no graph to run)")
    futures = _run_pass(ctx, list(roots), [torch.ones_like(r) for r in roots], retain_graph)
    for fut in futures:
        fut.wait()
