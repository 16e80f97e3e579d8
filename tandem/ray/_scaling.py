"""How many ranks a Ray job has, what each reserves, and where they may land."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from tandem.errors import ArgumentError

__all__ = ["ScalingConfig", "STRATEGIES", "Placed", "assign_ranks"]

# Ray's placement group strategies: PACK fills nodes in turn, SPREAD spreads as it can,
# STRICT_SPREAD puts every rank on a node of its own (fails if there are fewer nodes)
STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")


@dataclasses.dataclass(frozen=True)
class ScalingConfig:
    """The ranks of a :class:`~tandem.ray.Trainer`: ``num_workers`` Ray actors, each
    reserving ``cpus_per_worker`` CPUs (fractions allowed) and ``resources_per_worker``
    further custom resources in a placement group of ``placement_strategy``."""

    num_workers: int
    cpus_per_worker: float = 1.0
    placement_strategy: str = "PACK"
    resources_per_worker: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) \
                or self.num_workers < 1:
            raise ArgumentError(f"ScalingConfig(num_workers={self.num_workers!r}): a job needs "
                                f"at least 1 worker (one Ray actor per rank)")
        cpus = self.cpus_per_worker
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) \
                or not math.isfinite(cpus) or cpus <= 0:
            raise ArgumentError(f"ScalingConfig(cpus_per_worker={cpus!r}): expected a number "
                                f"of CPUs > 0 (fractions such as 0.5 let ranks share a CPU)")
        if self.placement_strategy not in STRATEGIES:
            raise ArgumentError(f"ScalingConfig(placement_strategy="
                                f"{self.placement_strategy!r}): expected one of "
                                f"{', '.join(STRATEGIES)}")
        for name, amount in self.resources_per_worker.items():
            if name in ("CPU", "cpu"):
                raise ArgumentError("ScalingConfig(resources_per_worker={'CPU': ...}): give "
                                    "CPUs as cpus_per_worker")
            if not isinstance(amount, (int, float)) or not amount > 0:
                raise ArgumentError(f"ScalingConfig(resources_per_worker={{{name!r}: "
                                    f"{amount!r}}}): expected an amount > 0")

    def bundle(self) -> dict[str, float]:
        """What one rank reserves, as a placement group bundle."""
        return {"CPU": float(self.cpus_per_worker), **{k: float(v) for k, v in
                                                      self.resources_per_worker.items()}}

    def check_fits(self, nodes: Sequence[Mapping[str, Any]]) -> None:
        """Refuse, before anything waits, a job the live ``nodes`` (``ray.nodes()``) can
        never hold; a placement group that cannot be placed would wait forever."""
        alive = [n for n in nodes if n.get("Alive")]
        n = self.num_workers
        if self.placement_strategy == "STRICT_SPREAD" and n > len(alive):
            raise ArgumentError(f"ScalingConfig(num_workers={n}, placement_strategy="
                                f"'STRICT_SPREAD') needs a node per worker, and the Ray "
                                f"cluster has {len(alive)} alive; use SPREAD or PACK, or "
                                f"fewer workers")
        need = self.bundle()
        for name, amount in need.items():
            per_node = [float(node.get("Resources", {}).get(name, 0.0)) for node in alive]
            if self.placement_strategy == "STRICT_PACK":
                fits = max(per_node, default=0.0) >= amount * n
            else:  # bundles do not split across nodes: count whole bundles per node
                fits = sum(math.floor(c / amount + 1e-9) for c in per_node) >= n
            if not fits:
                raise ArgumentError(f"ScalingConfig(num_workers={n}, {name} {amount:g} per "
                                    f"worker): the Ray cluster's {len(alive)} alive node(s) "
                                    f"have {name} {[round(c, 3) for c in per_node]}, too "
                                    f"little for {n} workers; ask for less per worker, fewer "
                                    f"workers, or add nodes")


@dataclasses.dataclass(frozen=True)
class Placed:
    """Where one actor landed: Ray's node id and the node's address, host name, pid."""

    node_id: str
    ip: str
    host: str
    pid: int


def assign_ranks(placed: Sequence[Placed]) -> list[tuple[int, int, int, int]]:
    """Per actor (in bundle order): (rank, local rank, local world size, node rank).

    Ranks of a node are contiguous, as every launcher numbers them; nodes are numbered
    in the order their first actor appears, so bundle 0's actor is rank 0.
    """
    order: list[str] = []
    for p in placed:
        if p.node_id not in order:
            order.append(p.node_id)
    counts = {node: sum(1 for p in placed if p.node_id == node) for node in order}
    first: dict[str, int] = {}
    total = 0
    for node in order:
        first[node], total = total, total + counts[node]
    seen: dict[str, int] = {}
    out = []
    for p in placed:
        local = seen.get(p.node_id, 0)
        seen[p.node_id] = local + 1
        out.append((first[p.node_id] + local, local, counts[p.node_id], order.index(p.node_id)))
    return out
