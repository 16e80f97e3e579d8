"""Collective algorithms and the registry that picks one per call.

Built in, for all-reduce: ``naive`` (the oracle), ``doubling`` (recursive doubling,
latency-optimal, for payloads below ``TANDEM_RING_THRESHOLD``, four times that for two
ranks), ``ring`` (bandwidth-optimal, pipelined, for larger ones) and ``hierarchical``
(within each host, then across one leader per host, then back within each host; chosen
whenever a group spans hosts and some host has two or more of its ranks).
``TANDEM_ALGORITHM`` or ``group.algorithm_override["all_reduce"]`` forces one.

A custom algorithm is a function ``fn(op, flat_tensor, reduce_op)`` that uses
``op.send``/``op.recv``/``op.wait`` (see ``tandem.collectives.group.Op``)::

    def star(op, buf, redop): ...
    tandem.register_algorithm("all_reduce", "star", star)
    group.algorithm_override["all_reduce"] = "star"     # or TANDEM_ALGORITHM=star
"""

from __future__ import annotations

from typing import Callable

import torch

from tandem.collectives.algorithms.direct import (
    direct_gather,
    direct_scatter,
    pairwise_all_to_all,
)
from tandem.collectives.algorithms.doubling import doubling_all_reduce
from tandem.collectives.algorithms.hierarchical import (
    hierarchical_all_reduce,
    hierarchical_broadcast,
    host_layout,
)
from tandem.collectives.algorithms.naive import naive_all_reduce
from tandem.collectives.algorithms.ring import (
    even_bounds,
    link_chunk,
    ring,
    ring_all_reduce,
    ring_gather_into,
    segment_bounds,
    separate,
)
from tandem.collectives.algorithms.shm import shm_all_reduce, shm_all_reduce_many
from tandem.collectives.algorithms.shm_gather import shm_all_gather, shm_reduce_scatter
from tandem.collectives.algorithms.shm_rooted import shm_broadcast, shm_reduce
from tandem.collectives.algorithms.streamed import (
    hierarchical_all_gather,
    hierarchical_reduce_scatter,
)
from tandem.collectives.algorithms.tree import tree_broadcast, tree_reduce
from tandem.collectives.group import ProcessGroup
from tandem.errors import ArgumentError

__all__ = [
    "ALL_REDUCE",
    "register_algorithm",
    "select_all_reduce",
    "direct_gather",
    "direct_scatter",
    "pairwise_all_to_all",
    "even_bounds",
    "segment_bounds",
    "hierarchical_all_gather",
    "hierarchical_broadcast",
    "hierarchical_reduce_scatter",
    "ring",
    "ring_gather_into",
    "link_chunk",
    "separate",
    "host_layout",
    "shm_all_gather",
    "shm_all_reduce_many",
    "shm_broadcast",
    "shm_reduce",
    "shm_reduce_scatter",
    "tree_broadcast",
    "tree_reduce",
]

AllReduce = Callable[..., None]

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


def select_all_reduce(group: ProcessGroup, buf: torch.Tensor) -> tuple[str, AllReduce]:
    name = group.algorithm_override.get("all_reduce") or group.settings.algorithm
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
        nbytes = buf.numel() * buf.element_size()
        threshold = group.settings.ring_threshold
        if group.group_size == 2:
            # with two ranks the ring moves the same bytes as doubling in twice the steps;
            # it wins only once pipelining and halved reductions pay (measured: doubling
            # 1.6x gloo at 1 MB where the ring was 0.85x; the ring ahead from 4 MB)
            threshold *= 4
        big = nbytes >= threshold and buf.numel() >= group.group_size
        name = "ring" if big else "doubling"
    fn = ALL_REDUCE.get(name)
    if fn is None:
        raise ArgumentError(
            f"all_reduce algorithm {name!r} is not registered; known: {sorted(ALL_REDUCE)}")
    return name, fn
