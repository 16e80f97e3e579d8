"""Which algorithm each collective runs: the one place that chooses.

Every collective asks its ``select_*`` function once per call and runs what comes back:
a name (all_reduce's goes into the call's signature) and a function of one shape per
collective, which takes the call's buffers as ``api.py`` prepared them. A choice reads
only what every member sees alike (whether the group shares memory, which ranks share
a host, the settings, the call's sizes), so all ranks pick the same algorithm; a root
or a host leader then plays its own part in it. The rules, by group:

* **shared memory** (one host, backend ``shm``/``auto``): ``shm`` for all_reduce,
  broadcast, reduce, all_gather and reduce_scatter (one round through the staging
  arena); gather, scatter and all_to_all move messages, as below.
* **messages, one host or one rank per host**: all_reduce ``doubling``, ``ring`` from
  ``TANDEM_RING_THRESHOLD`` (four times that for two ranks); broadcast and reduce a
  binomial ``tree`` (a broadcast's down :func:`~.spanning.confirmed_broadcast`);
  all_gather and reduce_scatter the ``ring``.
* **messages, several hosts, some holding several ranks**: all_reduce ``hierarchical``;
  broadcast ``hierarchical`` (the root to its host's leader, a tree across the
  leaders, then each leader to its host's ranks, :mod:`~.spanning`; within a host whose
  ranks share memory through its own arena, :mod:`~.shm_spanning`); reduce, gather,
  scatter and all_to_all through the hosts' ``leaders`` below ``LEADERS_BELOW_BYTES``
  (``leaders.py``), so a host keeps connections to the other hosts' leaders only
  (within a host whose ranks share memory, scatter's hand-down through its arena,
  :func:`~.shm_spanning.arena_scatter`, and all_to_all's part, split table too,
  :mod:`~.shm_alltoall`); from it on a reduce ``two_level`` (rings within each host and
  among the leaders, ``streamed.two_level_reduce``; the ``tree`` when the buffer holds
  fewer elements than the largest host's ranks times the hosts), gather and scatter
  ``direct``, all_to_all ``pairwise``; all_gather and reduce_scatter through the hosts'
  ``leaders`` when each host's ranks are consecutive (and, for a reduction, the leaders'
  receive areas fit), else the ``ring``; a large reduce_scatter on such hosts
  ``two_level`` (a ring within each host, then the leaders), by all_reduce's two-level
  rule.
* **barrier**: ``doubling``; ``hierarchical`` on several hosts some holding several ranks
  (check in with each host's leader, the leaders meet, release: ``leaders_barrier``).
* **otherwise**: gather and scatter ``direct``, all_to_all ``pairwise``.

Rooted algorithms that move messages check the root with messages of their own
(:mod:`~tandem.collectives.algorithms.roots`; a broadcast's go up its own tree,
:mod:`~tandem.collectives.algorithms.spanning`); shared memory checks it in the arena
(a host's own arena, for a broadcast across hosts: :mod:`~.shm_spanning`).
``TANDEM_ALGORITHM``, ``group.algorithm_override`` and :func:`register_algorithm`
apply to all_reduce.

A device path (tensors on an accelerator, moved by that device's own library) plugs
in at the top of each ``select_*`` function: a branch on the tensors' device that
returns a function of the same shape, before the CPU rules above.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from tandem.collectives.algorithms._phases import host_layout, host_of_rank
from tandem.collectives.algorithms.direct import (direct_gather, direct_scatter,
                                                  pairwise_all_to_all)
from tandem.collectives.algorithms.doubling import doubling_all_reduce
from tandem.collectives.algorithms.flat import Flat
from tandem.collectives.algorithms.leaders import (leaders_all_to_all, leaders_gather,
                                                   leaders_reduce, leaders_scatter, rooted)
from tandem.collectives.algorithms.hierarchical import (hierarchical_all_reduce,
                                                        hierarchical_broadcast, two_level_fits)
from tandem.collectives.algorithms.leaders_barrier import leaders_barrier
from tandem.collectives.algorithms.naive import naive_all_reduce
from tandem.collectives.algorithms.ring import (Bounds, even_bounds, link_chunk, ring,
                                                ring_all_reduce, ring_gather_into, ring_pays,
                                                segment_bounds, separate)
from tandem.collectives.algorithms.roots import announce_root, confirm_root
from tandem.collectives.algorithms.shm import shm_all_reduce, shm_all_reduce_many, shm_barrier
from tandem.collectives.algorithms.shm_gather import shm_all_gather, shm_reduce_scatter
from tandem.collectives.algorithms.shm_alltoall import arena_all_to_all
from tandem.collectives.algorithms.shm_rooted import shm_broadcast, shm_reduce
from tandem.collectives.algorithms.shm_spanning import arena_scatter, host_shares_memory
from tandem.collectives.algorithms.streamed import (host_blocks, leaders_all_gather,
                                                    leaders_reduce_scatter, streamed_fits,
                                                    two_level_reduce, two_level_reduce_scatter)
from tandem.collectives.algorithms.tree import tree_reduce
from tandem.collectives.checks import any_shared
from tandem.collectives.group import Op, ProcessGroup
from tandem.collectives.reduce_op import ReduceOp
from tandem.errors import ArgumentError
from tandem.transport.base import Slot

__all__ = [
    "ALL_REDUCE", "register_algorithm", "select_all_reduce", "select_all_reduce_coalesced",
    "select_broadcast", "select_reduce", "select_all_gather", "select_all_gather_into_tensor",
    "select_gather", "select_scatter", "select_reduce_scatter", "select_all_to_all",
    "all_to_all_in_host_arena", "select_barrier",
]

# the shape of each collective's algorithms (``Op`` first; buffers flat unless noted)
AllReduce = Callable[..., None]  # (op, buf, reduce_op); user-registered ones too
AllReduceMany = Callable[[Op, list[torch.Tensor], ReduceOp], None]
Broadcast = Callable[[Op, torch.Tensor, int], None]  # (op, buf, root)
Reduce = Callable[[Op, torch.Tensor, int, ReduceOp], None]  # (op, buf, root, reduce_op)
AllGather = Callable[[Op, list[torch.Tensor], torch.Tensor], None]  # (op, caller's outs, mine)
AllGatherInto = Callable[[Op, torch.Tensor, int, torch.Tensor], None]  # (op, out, n, mine)
Gather = Callable[[Op, torch.Tensor, "list[torch.Tensor] | None", int], None]
Scatter = Callable[[Op, torch.Tensor, "list[torch.Tensor] | None", int], None]
# (op, caller's output, input: one flat tensor per rank, or one flat tensor holding each
# rank's output.numel() elements in rank order, reduce_op)
ReduceScatter = Callable[[Op, torch.Tensor, "torch.Tensor | list[torch.Tensor]", ReduceOp], None]
# (op, outs, ins, the sends made with the split check by peer, elements [sender][receiver])
AllToAll = Callable[[Op, list[torch.Tensor], list[torch.Tensor], "dict[int, Slot]",
                     list[list[int]]], None]

ALL_REDUCE: dict[str, AllReduce] = {
    "naive": naive_all_reduce,
    "doubling": doubling_all_reduce,
    "ring": ring_all_reduce,
    "shm": shm_all_reduce,
    "hierarchical": hierarchical_all_reduce,
}

_REGISTRIES: dict[str, dict[str, AllReduce]] = {"all_reduce": ALL_REDUCE}


def register_algorithm(collective: str, name: str, fn: AllReduce) -> None:
    """Make ``fn`` selectable by ``name`` for ``collective`` (currently "all_reduce")."""
    registry = _REGISTRIES.get(collective)
    if registry is None:
        raise ArgumentError(
            f"custom algorithms can be registered for {sorted(_REGISTRIES)}, not {collective!r}")
    if not callable(fn):
        raise ArgumentError(f"algorithm {name!r} must be callable")
    registry[name] = fn


# -- all_reduce ---------------------------------------------------------------------

def select_all_reduce(group: ProcessGroup, buf: torch.Tensor) -> tuple[str, AllReduce]:
    """The group's override or ``TANDEM_ALGORITHM`` when not ``auto``; else shared memory,
    hierarchical, then ring or doubling by size (:func:`~.ring.ring_pays`)."""
    override = group.algorithm_override.get("all_reduce")
    name = override or group.settings.algorithm
    if name == "auto" and group.shares_memory:
        name = "shm"  # every member maps every member's staging memory
    elif name == "shm" and not group.shares_memory:
        raise ArgumentError(
            f"all_reduce algorithm 'shm' needs a group whose ranks share memory (one host, "
            f"backend 'shm' or 'auto', TANDEM_SHM_ARENA not 0); group '{group.group_name}' "
            f"does not")
    if name == "auto" and host_layout(group) is not None:
        # ranks on several hosts, some sharing one: only one rank per host sends
        # across hosts (the check's cost per call is measured in host_layout)
        name = "hierarchical"
    if name == "auto":
        name = "ring" if ring_pays(group.settings, group.group_size, buf) else "doubling"
    fn = ALL_REDUCE.get(name)
    if fn is None:
        source = "group.algorithm_override['all_reduce']" if override else "TANDEM_ALGORITHM"
        raise ArgumentError(
            f"{source}={name!r}: no all_reduce algorithm of that name is registered; known: "
            f"auto, {', '.join(sorted(ALL_REDUCE))}; pick one, or register_algorithm first")
    return name, fn


def select_all_reduce_coalesced(group: ProcessGroup, bufs: list[torch.Tensor],
                                tensors: Sequence[torch.Tensor]) -> AllReduceMany | None:
    """Shared memory's streaming of every tensor as it is, or None: the caller packs them
    into one buffer and all-reduces that by :func:`select_all_reduce`. Tensors sharing
    memory (one listed twice) would be combined twice in place, so they are packed."""
    if (group.shares_memory and select_all_reduce(group, bufs[0])[0] == "shm"
            and not any_shared(tensors)):
        return shm_all_reduce_many
    return None


def select_barrier(group: ProcessGroup) -> tuple[str, AllReduce]:
    """A barrier is an all-reduce (MAX) of one byte; when the group's ranks share memory,
    one post each in its arena, nothing staged (no ring between them is made for it); across
    hosts, with some holding several ranks, the hosts check in with their leaders, which
    meet (:mod:`~.leaders_barrier`), so that only host leaders send across hosts (8
    hosts x 8: 31 ms against 85 ms per barrier, the whole group's doubling); else
    recursive doubling."""
    if group.shares_memory:
        return "shm", shm_barrier
    if host_layout(group) is not None:
        return "hierarchical", leaders_barrier
    return "doubling", ALL_REDUCE["doubling"]


# -- rooted: broadcast, reduce, gather, scatter ------------------------------------

def select_broadcast(group: ProcessGroup, buf: torch.Tensor) -> tuple[str, Broadcast]:
    if group.shares_memory:  # the arena checks the root itself (algorithms.shm_rooted)
        return "shm", shm_broadcast
    return ("tree" if host_layout(group) is None else "hierarchical"), hierarchical_broadcast


def _tree_reduce(o: Op, buf: torch.Tensor, root: int, redop: ReduceOp) -> None:
    # a custom op's non-roots wait for the root's announcement: they learn of a
    # different op in this call
    told = announce_root(o, root, wait=redop.fn is not None)
    tree_reduce(o, buf, root, redop)
    o.wait(*told)


def _leaders_reduce(o: Op, buf: torch.Tensor, root: int, redop: ReduceOp) -> None:
    layout = host_layout(o.group)
    assert layout is not None  # as select_reduce found it
    rooted(o, root, layout, lambda: leaders_reduce(o, buf, root, redop, layout))


def _two_level_reduce(o: Op, buf: torch.Tensor, root: int, redop: ReduceOp) -> None:
    layout = host_layout(o.group)
    assert layout is not None  # as select_reduce found it
    rooted(o, root, layout, lambda: two_level_reduce(o, buf, root, redop, layout))


def select_reduce(group: ProcessGroup, buf: torch.Tensor) -> tuple[str, Reduce]:
    """Across hosts, some holding several ranks: small buffers through the leaders'
    trees, large ones ``two_level`` (rings within each host and among the leaders: at
    8 hosts x 8, 16 MB, the binomial tree over all ranks was 0.48x gloo)."""
    if group.shares_memory:  # the arena checks the root itself (algorithms.shm_rooted)
        return "shm", shm_reduce
    layout = host_layout(group)
    if layout is not None:
        if _leaders_pay(buf.numel() * buf.element_size()):
            return "leaders", _leaders_reduce
        if buf.numel() >= max(len(ranks) for ranks in layout) * len(layout):
            return "two_level", _two_level_reduce
    return "tree", _tree_reduce


def _direct_gather(o: Op, mine: torch.Tensor, outs: list[torch.Tensor] | None,
                   root: int) -> None:
    told = announce_root(o, root)
    direct_gather(o, mine, outs, root)
    o.wait(*told)


def _direct_scatter(o: Op, mine: torch.Tensor, ins: list[torch.Tensor] | None,
                    root: int) -> None:
    told = confirm_root(o, root)
    direct_scatter(o, mine, ins, root)
    o.wait(*told)


def _leaders_gather_to(o: Op, mine: torch.Tensor, outs: list[torch.Tensor] | None,
                       root: int) -> None:
    layout = host_layout(o.group)
    assert layout is not None  # as select_gather found it
    rooted(o, root, layout, lambda: leaders_gather(o, mine, outs, root, layout))


def _leaders_scatter(o: Op, mine: torch.Tensor, ins: list[torch.Tensor] | None,
                     root: int) -> None:
    layout = host_layout(o.group)
    assert layout is not None  # as select_scatter found it
    if host_shares_memory(o.group, host_of_rank(layout, o.group.group_rank)):
        # the hand-down within the host through its arena: no message, nor wake-up, per rank
        arena_scatter(o, mine, ins, root, layout)
        return
    rooted(o, root, layout, lambda: leaders_scatter(o, mine, ins, root, layout), down=True)


# Below this many bytes per call (reduce: the buffer; gather, scatter: the root's whole
# list; all_to_all: what the rank sending most sends to other hosts) rooted calls and
# all_to_all across hosts go through the leaders; from it on straight to their peers
# (at 16 MB the leaders were 1.2-7x slower, at 1 MB even: docs/benchmarks.md#scale-leaders).
LEADERS_BELOW_BYTES = 4 << 20


def _leaders_pay(nbytes: int) -> bool:
    return nbytes < LEADERS_BELOW_BYTES


def select_gather(group: ProcessGroup, buf: torch.Tensor) -> tuple[str, Gather]:
    nbytes = buf.numel() * buf.element_size() * group.group_size
    if host_layout(group) is not None and _leaders_pay(nbytes):
        return "leaders", _leaders_gather_to
    return "direct", _direct_gather


def select_scatter(group: ProcessGroup, buf: torch.Tensor) -> tuple[str, Scatter]:
    nbytes = buf.numel() * buf.element_size() * group.group_size
    if host_layout(group) is not None and _leaders_pay(nbytes):
        return "leaders", _leaders_scatter
    return "direct", _direct_scatter


# -- all_gather ---------------------------------------------------------------------

def _shm_all_gather(o: Op, outs: list[torch.Tensor], mine: torch.Tensor) -> None:
    flats = [Flat(t, load=False) for t in outs]
    shm_all_gather(o, [f.flat for f in flats], mine.reshape(-1))
    for f in flats:
        f.done()


def _ring_all_gather_into(o: Op, outs: list[torch.Tensor], mine: torch.Tensor) -> None:
    """The ring writing each part in its own tensor (see ``ring.separate``)."""
    g = o.group
    outs[g.group_rank].copy_(mine.reshape(outs[g.group_rank].shape))
    ring_gather_into(o, outs, link_chunk(g))


def _ring_gather(o: Op, flat: torch.Tensor, bounds: Bounds) -> None:
    ring(o, flat, bounds, None, reduce_scatter=False, all_gather=True,
         chunk_bytes=link_chunk(o.group))


def _leaders_gather(o: Op, flat: torch.Tensor, bounds: Bounds) -> None:
    layout = host_layout(o.group)
    blocks = host_blocks(layout, bounds)
    assert layout is not None and blocks is not None  # as select_* found them
    leaders_all_gather(o, flat, bounds, layout, blocks)


def _staged(gather: Callable[[Op, torch.Tensor, Bounds], None]) -> AllGather:
    """``gather`` run on the group's working memory, the parts copied in and out."""
    def staged(o: Op, outs: list[torch.Tensor], mine: torch.Tensor) -> None:
        g = o.group
        bounds = segment_bounds([t.numel() for t in outs])
        # the group's working memory, not a fresh buffer: at 4 x 64 MB, faulting a new
        # one in cost more than the copies (an all-gather's ring and leaders use no scratch)
        flat = g.scratch(bounds[-1][1], mine.dtype)
        a, b = bounds[g.group_rank]
        flat[a:b].copy_(mine.reshape(-1))
        gather(o, flat, bounds)
        with torch.no_grad():
            for t, (a, b) in zip(outs, bounds):
                t.copy_(flat[a:b].view(t.shape))
    return staged


_STAGED_RING = _staged(_ring_gather)
_STAGED_LEADERS = _staged(_leaders_gather)


def select_all_gather(group: ProcessGroup, outs: list[torch.Tensor]) -> tuple[str, AllGather]:
    """For a list of outputs: the ring writes into them when they are separate tensors
    and the group is flat; otherwise the parts go through the group's working memory."""
    if group.shares_memory:
        return "shm", _shm_all_gather
    layout = host_layout(group)
    if layout is None:
        return "ring", _ring_all_gather_into if separate(outs) else _STAGED_RING
    # through the hosts' leaders when the group spans hosts in blocks of consecutive ranks
    if host_blocks(layout, segment_bounds([t.numel() for t in outs])) is None:
        return "ring", _STAGED_RING
    return "leaders", _STAGED_LEADERS


def _shm_all_gather_into(o: Op, out: torch.Tensor, n: int, mine: torch.Tensor) -> None:
    shm_all_gather(o, list(out.split(n)) if n else [out] * o.group.group_size, mine.reshape(-1))


def _in_place(gather: Callable[[Op, torch.Tensor, Bounds], None]) -> AllGatherInto:
    def in_place(o: Op, out: torch.Tensor, n: int, mine: torch.Tensor) -> None:
        r, p = o.group.group_rank, o.group.group_size
        out[r * n:(r + 1) * n].copy_(mine.reshape(-1))
        gather(o, out, [(i * n, (i + 1) * n) for i in range(p)])
    return in_place


_RING_INTO = _in_place(_ring_gather)
_LEADERS_INTO = _in_place(_leaders_gather)


def select_all_gather_into_tensor(group: ProcessGroup, n: int) -> tuple[str, AllGatherInto]:
    """For one output holding every rank's ``n`` elements in rank order."""
    if group.shares_memory:
        return "shm", _shm_all_gather_into
    layout = host_layout(group)
    if layout is None or host_blocks(layout, even_bounds(n * group.group_size,
                                                         group.group_size)) is None:
        return "ring", _RING_INTO
    return "leaders", _LEADERS_INTO


# -- reduce_scatter -----------------------------------------------------------------

def _pieces(o: Op, output: torch.Tensor, ins: torch.Tensor | list[torch.Tensor]
            ) -> list[torch.Tensor]:
    """Each rank's piece of a reduce-scatter's input."""
    if isinstance(ins, list):
        return ins
    n = output.numel()
    return list(ins.split(n)) if n else [ins] * o.group.group_size


def _shm_reduce_scatter(o: Op, output: torch.Tensor, ins: torch.Tensor | list[torch.Tensor],
                        redop: ReduceOp) -> None:
    out = Flat(output, load=False)
    shm_reduce_scatter(o, out.flat, _pieces(o, output, ins), redop)
    out.done()


def _packed(scatter: Callable[[Op, torch.Tensor, Bounds, ReduceOp], None]) -> ReduceScatter:
    """``scatter`` run on a copy of the inputs packed into one buffer (the caller's
    inputs stay untouched), this rank's piece copied out."""
    def packed(o: Op, output: torch.Tensor, ins: torch.Tensor | list[torch.Tensor],
               redop: ReduceOp) -> None:
        # one tensor is cloned whole: splitting it to concatenate the pieces cost 3.7 us
        # more at 8 KB (measured)
        flat = torch.cat(ins) if isinstance(ins, list) else ins.clone()
        bounds = segment_bounds([t.numel() for t in ins] if isinstance(ins, list) else
                                [output.numel()] * o.group.group_size)
        scatter(o, flat, bounds, redop)
        a, b = bounds[o.group.group_rank]
        with torch.no_grad():
            output.copy_(flat[a:b].view(output.shape))
    return packed


def _ring_reduce_scatter(o: Op, flat: torch.Tensor, bounds: Bounds, redop: ReduceOp) -> None:
    ring(o, flat, bounds, redop, reduce_scatter=True, all_gather=False,
         chunk_bytes=link_chunk(o.group))


def _leaders_reduce_scatter(o: Op, flat: torch.Tensor, bounds: Bounds, redop: ReduceOp) -> None:
    layout = host_layout(o.group)
    blocks = host_blocks(layout, bounds)
    assert layout is not None and blocks is not None  # as select_reduce_scatter found them
    leaders_reduce_scatter(o, flat, bounds, redop, layout, blocks)


def _two_level_reduce_scatter(o: Op, flat: torch.Tensor, bounds: Bounds,
                              redop: ReduceOp) -> None:
    layout = host_layout(o.group)
    blocks = host_blocks(layout, bounds)
    assert layout is not None and blocks is not None  # as select_reduce_scatter found them
    two_level_reduce_scatter(o, flat, bounds, redop, layout, blocks)


_PACKED_RING = _packed(_ring_reduce_scatter)
_PACKED_LEADERS = _packed(_leaders_reduce_scatter)
_PACKED_TWO_LEVEL = _packed(_two_level_reduce_scatter)


def select_reduce_scatter(group: ProcessGroup, sizes: list[int],
                          dtype: torch.dtype) -> tuple[str, ReduceScatter]:
    """``sizes``: each rank's piece in elements. Through the hosts' leaders when the
    group spans hosts in blocks of consecutive ranks and each leader's receive areas
    (one whole buffer per other rank of its host) fit, else the ring."""
    if group.shares_memory:
        return "shm", _shm_reduce_scatter
    layout = host_layout(group)
    if layout is None or host_blocks(layout, segment_bounds(sizes)) is None:
        return "ring", _PACKED_RING
    numel = sum(sizes)
    if two_level_fits(group.settings, layout, numel, numel * dtype.itemsize):
        # a ring within each host first: at 2 hosts x 8, 16 MB, each leader otherwise
        # set aside 7 x 16 MB per call and reduced them alone
        return "two_level", _PACKED_TWO_LEVEL
    if not streamed_fits(layout, sum(sizes) * dtype.itemsize):
        return "ring", _PACKED_RING
    return "leaders", _PACKED_LEADERS


# -- all_to_all ---------------------------------------------------------------------

def _pairwise(o: Op, outs: list[torch.Tensor], ins: list[torch.Tensor],
              sent: dict[int, Slot], counts: list[list[int]]) -> None:
    pairwise_all_to_all(o, outs, ins, sent)


def _most_across(counts: list[list[int]], layout: list[list[int]]) -> int:
    """What the rank sending other hosts most sends them, in elements: a rank's total less
    what stays on its host (a loop over every pair: ~0.5 ms at 64 ranks)."""
    return max(sum(counts[a]) - sum(counts[a][b] for b in ranks) for ranks in layout for a in ranks)


def _leaders_all_to_all(o: Op, outs: list[torch.Tensor], ins: list[torch.Tensor],
                        sent: dict[int, Slot], counts: list[list[int]]) -> None:
    """Through the leaders unless some rank sends other hosts too much: ``counts`` came
    through the leaders (alltoall.py), so every rank makes the same choice here."""
    layout = host_layout(o.group)
    assert layout is not None and not sent  # as select_all_to_all found it
    if _leaders_pay(_most_across(counts, layout) * ins[0].element_size()):
        leaders_all_to_all(o, outs, ins, counts, layout)
    else:
        pairwise_all_to_all(o, outs, ins, {})


def all_to_all_in_host_arena(o: Op, outs: list[torch.Tensor], ins: list[torch.Tensor],
                             mine: torch.Tensor,
                             check_table: Callable[[list[torch.Tensor]], list[list[int]]]
                             ) -> bool:
    """The "leaders" all_to_all, split table included, with this rank's host's part in
    its arena (:func:`~.shm_alltoall.arena_all_to_all`) when the host's ranks share
    memory; False, nothing moved, when they do not (the caller exchanges the table
    through the leaders' messages and runs :func:`_leaders_all_to_all`)."""
    layout = host_layout(o.group)
    assert layout is not None  # as select_all_to_all found it
    if not host_shares_memory(o.group, host_of_rank(layout, o.group.group_rank)):
        return False
    size = ins[0].element_size()
    return arena_all_to_all(o, outs, ins, mine, check_table,
                            lambda counts: _leaders_pay(_most_across(counts, layout) * size),
                            layout)


def select_all_to_all(group: ProcessGroup) -> tuple[str, AllToAll]:
    """Every piece straight to its receiver (after the split check, alltoall.py); across
    hosts, some holding several ranks, through the hosts' leaders (the split check too)."""
    if host_layout(group) is not None:
        return "leaders", _leaders_all_to_all
    return "pairwise", _pairwise

