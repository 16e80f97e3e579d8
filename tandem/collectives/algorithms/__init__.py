"""Collective algorithms, and the one place that picks one per call (``select.py``).

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

from tandem.collectives.algorithms.hierarchical import hierarchical_broadcast, host_layout
from tandem.collectives.algorithms.ring import (
    even_bounds,
    link_chunk,
    ring,
    ring_gather_into,
    segment_bounds,
    separate,
)
from tandem.collectives.algorithms.select import (
    ALL_REDUCE,
    register_algorithm,
    select_all_gather,
    select_all_gather_into_tensor,
    select_all_reduce,
    select_all_reduce_coalesced,
    select_all_to_all,
    select_barrier,
    select_broadcast,
    select_gather,
    select_reduce,
    select_reduce_scatter,
    select_scatter,
)
from tandem.collectives.algorithms.tree import tree_broadcast, tree_reduce

__all__ = [
    "ALL_REDUCE",
    "register_algorithm",
    "select_all_reduce",
    "select_all_reduce_coalesced",
    "select_all_gather",
    "select_all_gather_into_tensor",
    "select_all_to_all",
    "select_barrier",
    "select_broadcast",
    "select_gather",
    "select_reduce",
    "select_reduce_scatter",
    "select_scatter",
    "even_bounds",
    "segment_bounds",
    "hierarchical_broadcast",
    "ring",
    "ring_gather_into",
    "link_chunk",
    "separate",
    "host_layout",
    "tree_broadcast",
    "tree_reduce",
]
