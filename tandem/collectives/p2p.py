"""Point-to-point: send, recv (from any source too), isend, irecv, batched P2POp.

Messages between two ranks with the same tag arrive in the order they were sent.
``dst``/``src`` are global ranks as in torch (``group_dst``/``group_src`` take
group ranks). A blocking call has the group's timeout as its deadline; a peer
that dies while we wait on it is reported at once.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from tandem.collectives.api import call_site
from tandem.collectives.checks import (crossed, output_arg, overlapping_pair, root_rank, tag_arg,
                                      tensor_arg)
from tandem.collectives.group import ProcessGroup, as_bytes
from tandem.collectives.recorder import Call
from tandem.collectives.work import Work
from tandem.collectives.world import AnyGroup, resolve_group
from tandem.errors import ArgumentError
from tandem.transport.base import Slot

__all__ = ["send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv"]


def _peer(g: ProcessGroup, what: str, rank: int | None, group_rank: int | None, name: str) -> int:
    if rank is None and group_rank is None:
        raise ArgumentError(f"{what}: {name} is required")
    peer = root_rank(g, what, rank, group_rank, name)
    if peer == g.group_rank:
        raise ArgumentError(f"{what}: {name} is this rank itself ({g.ranks[peer]})")
    return peer


def _contiguous(t: torch.Tensor, what: str, output: bool = False) -> torch.Tensor:
    (output_arg if output else tensor_arg)(t, what, "tensor")
    if not t.is_contiguous():
        raise ArgumentError(f"{what}: tensor must be contiguous")
    return t


_DTYPE_SIGS: dict[torch.dtype, bytes] = {}


def _dtype_sig(dtype: torch.dtype) -> bytes:
    """What a send's header says of its tensor, so a receive into another dtype fails."""
    sig = _DTYPE_SIGS.get(dtype)
    if sig is None:
        sig = _DTYPE_SIGS[dtype] = str(dtype).removeprefix("torch.").encode()
    return sig


def _work(g: ProcessGroup, slot: Slot, what: str, result: Any, call: Call | None) -> Work:
    work = Work(f"{what} on group '{g.group_name}'", result, g.completions)

    def done(s: Slot) -> None:
        work._source = g.ranks.index(s.peer) if s.peer in g.ranks else -1
        if call is not None:  # [recorder] the send or receive finished
            call.peer = s.peer if s.peer >= 0 else call.peer
            g.recorder.end_p2p(call, s.error)
        work._complete(error=s.error)

    def drive(timeout: float | None) -> None:
        # Only the group's deadline fails the operation (wait_p2p cancels the receive when
        # it passes). A caller's own wait(timeout) that runs out must leave the receive
        # posted, as for collectives: else waiting again never completes and the message,
        # arriving later, is dropped silently. Work.wait then waits on completion itself.
        if timeout is None:
            g.wait_p2p(slot, timeout, what)

    work._waiter = drive
    slot.on_done = done
    if slot.done():
        done(slot)
    return work


def isend(tensor: torch.Tensor, dst: int | None = None, group: AnyGroup | None = None,
          tag: int = 0, group_dst: int | None = None) -> Work:
    return _isend(tensor, dst, group, tag, group_dst, "isend")


def _isend(tensor: torch.Tensor, dst: int | None, group: AnyGroup | None, tag: int,
           group_dst: int | None, name: str) -> Work:
    # ``name`` is the function the user called, so that an error names send or isend
    g = resolve_group(group, name)
    tag_arg(tag, name)
    peer = _peer(g, name, dst, group_dst, "dst")
    view, site = as_bytes(_contiguous(tensor, name)), call_site()
    call = g.recorder.begin_p2p("send", g.ranks[peer], tag, len(view), site)  # [recorder]
    slot = g.p2p_send(peer, tag, view, site, _dtype_sig(tensor.dtype))
    return _work(g, slot, f"{name} to rank {g.ranks[peer]} (tag {tag})", [tensor], call)


def irecv(tensor: torch.Tensor, src: int | None = None, group: AnyGroup | None = None,
          tag: int = 0, group_src: int | None = None) -> Work:
    return _irecv(tensor, src, group, tag, group_src, "irecv")


def _irecv(tensor: torch.Tensor, src: int | None, group: AnyGroup | None, tag: int,
           group_src: int | None, name: str) -> Work:
    g = resolve_group(group, name)
    tag_arg(tag, name)
    peer = None if src is None and group_src is None else _peer(g, name, src, group_src, "src")
    view = as_bytes(_contiguous(tensor, name, output=True))
    call = g.recorder.begin_p2p("recv", -1 if peer is None else g.ranks[peer], tag,  # [recorder]
                                len(view), call_site())
    slot = g.p2p_recv(peer, tag, view, _dtype_sig(tensor.dtype))
    who = "any rank" if peer is None else f"rank {g.ranks[peer]}"
    return _work(g, slot, f"{name} from {who} (tag {tag})", [tensor], call)


def send(tensor: torch.Tensor, dst: int | None = None, group: AnyGroup | None = None,
         tag: int = 0, group_dst: int | None = None) -> None:
    _isend(tensor, dst, group, tag, group_dst, "send").wait()


def recv(tensor: torch.Tensor, src: int | None = None, group: AnyGroup | None = None,
         tag: int = 0, group_src: int | None = None) -> int:
    """Receive into ``tensor``; return the sender's global rank (useful with src=None)."""
    g = resolve_group(group, "recv")
    work = _irecv(tensor, src, group, tag, group_src, "recv")
    work.wait()
    return g.ranks[work._source]


class P2POp:
    """One operation of :func:`batch_isend_irecv`: ``P2POp(tandem.isend, t, peer)``."""

    def __init__(self, op: Callable[..., Work], tensor: torch.Tensor, peer: int | None = None,
                 group: AnyGroup | None = None, tag: int = 0, group_peer: int | None = None) -> None:
        if op not in (isend, irecv, send, recv):
            raise ArgumentError("P2POp op must be tandem.isend or tandem.irecv")
        tag_arg(tag, "P2POp")  # checked here, so a batch never starts half-way
        self.op = isend if op in (isend, send) else irecv
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag
        self.group_peer = group_peer


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Post every receive, then every send; return their Works in list order."""
    if not p2p_op_list or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ArgumentError("batch_isend_irecv takes a non-empty list of P2POp")
    _distinct_receives(p2p_op_list)
    works: dict[int, Work] = {}
    for i, p in enumerate(p2p_op_list):
        if p.op is irecv:
            works[i] = irecv(p.tensor, p.peer, p.group, p.tag, p.group_peer)
    for i, p in enumerate(p2p_op_list):
        if p.op is isend:
            works[i] = isend(p.tensor, p.peer, p.group, p.tag, p.group_peer)
    return [works[i] for i in range(len(p2p_op_list))]


def _distinct_receives(ops: Sequence[P2POp]) -> None:
    """Refuse receives into shared memory (one would overwrite the other's data) and
    receives into memory a send of the batch reads (it might be sent half overwritten)."""
    what = "batch_isend_irecv"
    for i, p in enumerate(ops):
        tensor_arg(p.tensor, what, f"p2p_op_list[{i}].tensor")
    recvs = [i for i, p in enumerate(ops) if p.op is irecv]
    sends = [i for i, p in enumerate(ops) if p.op is isend]
    pair = overlapping_pair([ops[i].tensor for i in recvs])
    if pair is not None:
        a, b = recvs[pair[0]], recvs[pair[1]]
        raise ArgumentError(f"{what}: the receives p2p_op_list[{a}] and p2p_op_list[{b}] "
                            f"overlap in memory; each needs a tensor of its own")
    if sends and recvs and crossed([ops[i].tensor for i in sends], [ops[i].tensor for i in recvs]):
        for r in recvs:
            for s in sends:
                if overlapping_pair([ops[r].tensor, ops[s].tensor]) is not None:
                    raise ArgumentError(
                        f"{what}: the receive p2p_op_list[{r}] overlaps in memory the send "
                        f"p2p_op_list[{s}], which may be read after the receive wrote it: "
                        f"send a copy (.clone())")
