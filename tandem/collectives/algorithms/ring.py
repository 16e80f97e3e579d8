"""Ring algorithms: reduce-scatter, all-gather, and all-reduce as the two in a row.

The buffer is cut into one segment per rank (``bounds``), and every segment into
chunks of ``chunk_bytes`` (at most eight per segment; ``link_chunk_bytes`` when the
group spans hosts, see :func:`link_chunk`). Every receive of the call is
posted before the first send. Messages travel to the next rank only. Each received
chunk is reduced and immediately forwarded, so the wire, the reduction kernel and
the peer's reduction overlap (a pipelined ring). Every rank sends and receives
``2 (p-1)/p`` of the buffer in an all-reduce: bandwidth-optimal, which is why it is
chosen for large tensors.

Step ``t`` of the reduce-scatter phase sends segment ``r-t-1`` and receives
segment ``r-t-2``; after ``p-1`` steps rank ``r`` holds the reduced segment ``r``.
Step ``t`` of the all-gather phase sends segment ``r-t`` and receives ``r-t-1``
straight into place. The segment received in one step is the one sent in the
next, chunk by chunk.
"""

from __future__ import annotations

from typing import Callable

import torch

from tandem.collectives.group import Op, ProcessGroup, as_bytes, spans_hosts
from tandem.collectives.reduce_op import ReduceOp, combine, finish
from tandem.config import Settings

__all__ = ["ring", "ring_pieces", "even_bounds", "segment_bounds", "ring_all_reduce",
           "link_chunk", "ring_gather_into", "separate", "ring_pays"]

Bounds = list[tuple[int, int]]
Hook = Callable[[int, int], None]

_MAX_CHUNKS = 8


def segment_bounds(sizes: list[int]) -> Bounds:
    """``(start, end)`` of consecutive segments of ``sizes`` elements each."""
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


def even_bounds(numel: int, parts: int) -> Bounds:
    """``parts`` segments covering ``numel`` elements, the first ones one element longer."""
    base, extra = divmod(numel, parts)
    return segment_bounds([base + (1 if i < extra else 0) for i in range(parts)])


def _chunks(bounds: tuple[int, int], chunk: int) -> list[tuple[int, int]]:
    a, b = bounds
    if b - a <= chunk:
        return [(a, b)]
    return [(s, min(s + chunk, b)) for s in range(a, b, chunk)]


def ring_pays(settings: Settings, size: int, buf: torch.Tensor) -> bool:
    """Whether an all-reduce of ``buf`` among ``size`` ranks takes the ring (else doubling)."""
    threshold = settings.ring_threshold
    if size == 2:
        # with two ranks the ring moves the same bytes as doubling in twice the steps;
        # it wins only once pipelining and halved reductions pay (measured: doubling
        # 1.6x gloo at 1 MB where the ring was 0.85x; the ring ahead from 4 MB)
        threshold *= 4
    return buf.numel() * buf.element_size() >= threshold and buf.numel() >= size


def link_chunk(group: ProcessGroup) -> int | None:
    """The pipeline chunk in bytes of a flat algorithm over ``group`` when its ranks are on
    several hosts (the smaller of ``link_chunk_bytes`` and ``chunk_bytes``), else None.

    Every rank of the group gets the same answer, as the ring's pieces must agree.
    """
    # pieces a few bandwidth-delay products long keep a delayed link busy; 256 KiB took
    # 25-40% less CPU than 128 KiB at 1 Gbit/s, 0.2 ms (docs/design.md, "Ring pieces"), and
    # at 4x1, 1 MB, four 64 KiB pieces per segment lost too (docs/benchmarks.md#shaped-1mb)
    if not spans_hosts(group):
        return None
    settings = group.settings
    return min(settings.link_chunk_bytes, settings.chunk_bytes)


def ring_pieces(settings: Settings, bounds: Bounds, itemsize: int,
                chunk_bytes: int | None = None) -> list[list[tuple[int, int]]]:
    """The chunks (element ranges) :func:`ring` cuts each segment of ``bounds`` into
    (of ``chunk_bytes``, default ``settings.chunk_bytes``, at most eight per segment)."""
    longest = max(b - a for a, b in bounds)
    # at most _MAX_CHUNKS per segment: more posted messages set off full GC passes of
    # 50-1000 ms at 3 ranks x 64 MB (docs/design.md, "Ring pieces")
    nbytes = chunk_bytes or settings.chunk_bytes
    chunk = max(1, nbytes // max(1, itemsize), -(-longest // _MAX_CHUNKS))
    return [_chunks(b, chunk) for b in bounds]


def ring(op: Op, buf: torch.Tensor, bounds: Bounds, redop: ReduceOp | None,
         reduce_scatter: bool, all_gather: bool, ready: Hook | None = None,
         done: Hook | None = None, chunk_bytes: int | None = None,
         src: torch.Tensor | None = None) -> None:
    """Run the reduce-scatter and/or all-gather phase on flat ``buf`` in place.

    ``ready(a, b)`` is called for every chunk (see :func:`ring_pieces`) before this
    rank first reads ``buf[a:b]``, and ``done(a, b)`` once ``buf[a:b]`` holds its
    final bytes (a chunk this rank finished reducing, or of its own segment in an
    all-gather, right after it went out; every chunk the all-gather brings), so a
    caller can produce the input and consume the output chunk by chunk while the
    ring runs. ``chunk_bytes`` overrides ``settings.chunk_bytes`` (see :func:`link_chunk`).
    ``src`` (a reduce-scatter): this rank's contribution, read and left unchanged, where
    ``buf``'s prior bytes are then never read: each chunk is reduced from ``src`` into
    ``buf``, with no copy of ``src`` first.
    """
    g = op.group
    p, r = g.group_size, g.group_rank
    own = buf if src is None or not reduce_scatter else src
    if p == 1:
        if own is not buf:
            buf.copy_(own)
        if ready is not None:
            ready(0, buf.numel())
        if reduce_scatter:
            finish(redop, buf, 1)  # type: ignore[arg-type]
        if done is not None:
            done(0, buf.numel())
        return
    nxt, prv = (r + 1) % p, (r - 1) % p
    steps: list[tuple[bool, int, int]] = []  # (reducing, send segment, receive segment)
    if reduce_scatter:
        steps += [(True, (r - t - 1) % p, (r - t - 2) % p) for t in range(p - 1)]
    if all_gather:
        steps += [(False, (r - t) % p, (r - t - 1) % p) for t in range(p - 1)]
    longest = max(b - a for a, b in bounds)
    pieces = ring_pieces(g.settings, bounds, buf.element_size(), chunk_bytes)
    stride = max(len(c) for c in pieces)
    scratch: list[torch.Tensor] = []
    if reduce_scatter:
        # one landing area per step, so every receive is posted before the call starts
        # (posted one step ahead, 5-18 MB of a 64 MB all-reduce at 3 ranks was parked)
        space = g.scratch(longest * (p - 1), buf.dtype)
        scratch = [space[i * longest:(i + 1) * longest] for i in range(p - 1)]
    # byte views are made once and sliced: a tensor-to-memoryview conversion per chunk
    # showed up in profiles
    size = buf.element_size()
    whole = as_bytes(buf)
    first = whole if own is buf else as_bytes(own)  # what step 0 sends
    scratch_bytes = [as_bytes(t) for t in scratch]

    def post(t: int) -> list:
        reducing, _, seg = steps[t]
        if reducing:
            base, mem = bounds[seg][0], scratch_bytes[t]
            views = [mem[(a - base) * size:(b - base) * size] for a, b in pieces[seg]]
        else:
            # the all-gather's receives land in place: a segment's final bytes arrive
            # only after this rank's last send from that segment was read
            views = [whole[a * size:b * size] for a, b in pieces[seg]]
        return [op.recv(prv, t * stride + c, v) for c, v in enumerate(views)]

    posted = [post(t) for t in range(len(steps))]
    sends = []
    for c, (a, b) in enumerate(pieces[steps[0][1]]):
        if ready is not None:
            ready(a, b)
        sends.append(op.send(nxt, c, first[a * size:b * size]))
        if done is not None and not reduce_scatter:  # an all-gather's own segment
            done(a, b)
    last_reduce = p - 2 if reduce_scatter else -1
    for t, (reducing, _, seg) in enumerate(steps):
        base = bounds[seg][0]
        for c, slot in enumerate(posted[t]):
            op.wait(slot)
            a, b = pieces[seg][c]
            if reducing:
                if ready is not None:
                    ready(a, b)
                mine = buf[a:b]
                combine(redop, scratch[t][a - base:b - base], own[a:b], mine)  # type: ignore[arg-type]
                if t == last_reduce:
                    finish(redop, mine, p)  # type: ignore[arg-type]
            if done is not None and (t == last_reduce or not reducing):
                done(a, b)
            if t + 1 < len(steps):
                sends.append(op.send(nxt, (t + 1) * stride + c, whole[a * size:b * size]))
    op.wait(*sends)


def ring_all_reduce(op: Op, buf: torch.Tensor, redop: ReduceOp) -> None:
    ring(op, buf, even_bounds(buf.numel(), op.group.group_size), redop, True, True,
         chunk_bytes=link_chunk(op.group))


def separate(ts: list[torch.Tensor]) -> bool:
    """Whether every tensor of ``ts`` is contiguous and none shares memory with another:
    then :func:`ring_gather_into` can write each in place."""
    spans = []
    for t in ts:
        if not t.is_contiguous():
            return False
        if t.numel():
            start = t.data_ptr()
            spans.append((start, start + t.numel() * t.element_size()))
    spans.sort()
    return all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))


def ring_gather_into(op: Op, outs: list[torch.Tensor], chunk_bytes: int | None = None) -> None:
    """The ring's all-gather over separate tensors (see :func:`separate`): group rank ``m``
    holds its part in ``outs[m]``, and every rank ends with all of them.

    Each part lands in its tensor and is forwarded from there, so a list all-gather
    copies nothing but its input: through one flat buffer it copied every part twice
    (at 4 ranks x 1 MB, 5 MB of copies per call on the calling thread).
    """
    g = op.group
    p, r = g.group_size, g.group_rank
    if p == 1:
        return
    nxt, prv = (r + 1) % p, (r - 1) % p
    size = outs[0].element_size()
    views = [as_bytes(t) for t in outs]
    pieces = ring_pieces(g.settings, [(0, t.numel()) for t in outs], size, chunk_bytes)
    stride = max(len(c) for c in pieces)
    # step t sends part r - t and receives part r - t - 1, which the next step sends on
    order = [(r - t - 1) % p for t in range(p - 1)]
    posted = [[op.recv(prv, t * stride + c, views[part][a * size:b * size])
               for c, (a, b) in enumerate(pieces[part])] for t, part in enumerate(order)]
    sends = [op.send(nxt, c, views[r][a * size:b * size]) for c, (a, b) in enumerate(pieces[r])]
    for t, part in enumerate(order[:-1]):
        for c, slot in enumerate(posted[t]):
            op.wait(slot)
            a, b = pieces[part][c]
            sends.append(op.send(nxt, (t + 1) * stride + c, views[part][a * size:b * size]))
    op.wait(*posted[-1], *sends)
