"""Rank bodies for the leader-routing tests: every collective once on simulated hosts,
checked against an oracle computed from the inputs alone, and after each one the
cross-host TCP connections this rank holds (``connected`` on its transport)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

import tandem as dist
from tandem.bench._scale_failures import enter_host
from tandem.collectives.algorithms import select
from tandem.collectives.world import world as the_world

DTYPES = [torch.float32, torch.float64, torch.int64]
OPS = {"SUM": dist.ReduceOp.SUM, "MAX": dist.ReduceOp.MAX, "MIN": dist.ReduceOp.MIN,
       "PRODUCT": dist.ReduceOp.PRODUCT, "AVG": dist.ReduceOp.AVG}


def value(rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: distinct per rank and element, exact under every op here
    (small integers; products of at most 12 factors in {1, 2})."""
    t = (torch.arange(numel, dtype=torch.int64) * 7 + rank * 13 + salt) % 5
    return (1 + (t == 0).to(torch.int64) if salt < 0 else t - 2).to(dtype)


def oracle(op: str, parts: list[torch.Tensor]) -> torch.Tensor:
    s = torch.stack(parts)
    if op == "SUM":
        return s.sum(0)
    if op == "MAX":
        return s.max(0).values
    if op == "MIN":
        return s.min(0).values
    if op == "PRODUCT":
        return s.prod(0)
    return s.sum(0) / len(parts)


def _links(world: int, hosts: list[int]) -> list[int]:
    """The ranks on other hosts this rank is connected to."""
    transport = the_world().transport
    me = dist.get_rank()
    return [r for r in range(world) if hosts[r] != hosts[me] and transport.connected(r)]


def battery(rank: int, world: int, store: str, names: Sequence[str], addrs: Sequence[str],
            per_host: int, sizes: Sequence[int], large: Sequence[int]) -> dict[str, Any]:
    """Each collective in turn (first those known to cross hosts through leaders only),
    against the oracle; after each, this rank's cross-host connections. ``large``: sizes
    (elements) at which the rooted ones and all-to-all run once more, last."""
    enter_host(names, addrs, rank, per_host)
    dist.init_process_group("auto", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=60.0)
    hosts = [r // per_host for r in range(world)]
    wrong: list[str] = []
    links: dict[str, list[int]] = {}
    p = world
    # a root that is no host's leader, on the last host
    root = world - 2

    def step(name: str, body: Callable[[], None]) -> None:
        body()
        links[name] = _links(world, hosts)

    def all_reduce() -> None:
        t = value(rank, 100, torch.float32)
        dist.all_reduce(t)

    def barrier() -> None:
        dist.barrier()

    def broadcast() -> None:
        t = value(rank, 100, torch.float32)
        dist.broadcast(t, src=root)

    def reduce(sizes: Sequence[int] = sizes) -> None:
        for numel in sizes:
            for dtype in DTYPES:
                for name, op in OPS.items():
                    if name == "AVG" and not dtype.is_floating_point:
                        continue
                    salt = -1 if name == "PRODUCT" else 0
                    for r in (root, 0):
                        parts = [value(q, numel, dtype, salt) for q in range(p)]
                        t = parts[rank].clone()
                        dist.reduce(t, dst=r, op=op)
                        want = oracle(name, parts) if rank == r else parts[rank]
                        if not torch.equal(t, want.to(dtype)):
                            wrong.append(f"reduce {name} {dtype} {numel} to {r}")

    def gather(sizes: Sequence[int] = sizes) -> None:
        for numel in sizes:
            for dtype in DTYPES:
                for r in (root, 0):
                    parts = [value(q, numel, dtype) for q in range(p)]
                    outs = [torch.empty(numel, dtype=dtype) for _ in range(p)] \
                        if rank == r else None
                    dist.gather(parts[rank], outs, dst=r)
                    if outs is not None and not all(torch.equal(o, w)
                                                    for o, w in zip(outs, parts)):
                        wrong.append(f"gather {dtype} {numel} to {r}")

    def scatter(sizes: Sequence[int] = sizes) -> None:
        for numel in sizes:
            for dtype in DTYPES:
                for r in (root, 0):
                    parts = [value(q, numel, dtype, 3) for q in range(p)]
                    out = torch.empty(numel, dtype=dtype)
                    dist.scatter(out, parts if rank == r else None, src=r)
                    if not torch.equal(out, parts[rank]):
                        wrong.append(f"scatter {dtype} {numel} from {r}")

    def piece(src: int, dst: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        # sizes differ per pair, some empty
        return value(src * p + dst, (numel * (src + 2 * dst)) % (numel + 1), dtype)

    def all_to_all(sizes: Sequence[int] = sizes) -> None:
        for numel in sizes:
            for dtype in DTYPES:
                ins = [piece(rank, d, numel, dtype) for d in range(p)]
                outs = [torch.empty_like(piece(s, rank, numel, dtype)) for s in range(p)]
                dist.all_to_all(outs, ins)
                if not all(torch.equal(o, piece(s, rank, numel, dtype))
                           for s, o in enumerate(outs)):
                    wrong.append(f"all_to_all {dtype} {numel}")

    def all_to_all_single(sizes: Sequence[int] = sizes) -> None:
        for numel in sizes:
            for dtype in DTYPES:
                rows = [(numel * (rank + 2 * d)) % (numel + 1) for d in range(p)]
                back = [(numel * (s + 2 * rank)) % (numel + 1) for s in range(p)]
                inp = torch.cat([piece(rank, d, numel, dtype) for d in range(p)])
                out = torch.empty(sum(back), dtype=dtype)
                dist.all_to_all_single(out, inp, back, rows)
                want = torch.cat([piece(s, rank, numel, dtype) for s in range(p)])
                if not torch.equal(out, want):
                    wrong.append(f"all_to_all_single {dtype} {numel}")
                even = torch.arange(p * 3, dtype=dtype) + 100 * rank
                got = torch.empty_like(even)
                dist.all_to_all_single(got, even)
                want = torch.cat([torch.arange(3 * rank, 3 * rank + 3, dtype=dtype) + 100 * s
                                  for s in range(p)])
                if not torch.equal(got, want):
                    wrong.append(f"all_to_all_single even {dtype}")

    def all_gather() -> None:
        for numel in sizes:
            parts = [value(q, numel, torch.float32) for q in range(p)]
            outs = [torch.empty(numel) for _ in range(p)]
            dist.all_gather(outs, parts[rank])
            if not all(torch.equal(o, w) for o, w in zip(outs, parts)):
                wrong.append(f"all_gather {numel}")

    def reduce_scatter() -> None:
        for numel in sizes:
            rows = max(1, numel // p)
            full = [value(q, rows * p, torch.float32) for q in range(p)]
            out = torch.empty(rows)
            dist.reduce_scatter_tensor(out, full[rank])
            if not torch.equal(out, torch.stack(full).sum(0)[rank * rows:(rank + 1) * rows]):
                wrong.append(f"reduce_scatter {numel}")

    def objects() -> None:
        got: list[Any] = [None] * p
        dist.all_gather_object(got, {"rank": rank})
        if got != [{"rank": q} for q in range(p)]:
            wrong.append("all_gather_object")
        into: list[Any] | None = [None] * p if rank == root else None
        dist.gather_object(("r", rank), into, dst=root)
        if rank == root and into != [("r", q) for q in range(p)]:
            wrong.append("gather_object")
        lst: list[Any] = [f"from {root}", root] if rank == root else [None, None]
        dist.broadcast_object_list(lst, src=root)
        if lst != [f"from {root}", root]:
            wrong.append("broadcast_object_list")
        outl: list[Any] = [None]
        dist.scatter_object_list(outl, [q * 10 for q in range(p)] if rank == root else None,
                                 src=root)
        if outl != [rank * 10]:
            wrong.append("scatter_object_list")

    for name, body in [("all_reduce", all_reduce), ("barrier", barrier),
                       ("broadcast", broadcast), ("reduce", reduce), ("gather", gather),
                       ("scatter", scatter), ("all_to_all", all_to_all),
                       ("all_to_all_single", all_to_all_single), ("all_gather", all_gather),
                       ("reduce_scatter", reduce_scatter), ("objects", objects)]:
        step(name, body)
        dist.barrier()
    # from select.LEADERS_BELOW_BYTES on these go straight to their peers (measured faster),
    # and a reduce runs in two levels (streamed.two_level_reduce): lowered here so that
    # the large reduce takes that path at these sizes too
    select.LEADERS_BELOW_BYTES = 64 << 10
    step("large", lambda: [f(large) for f in (reduce, gather, scatter, all_to_all,
                                              all_to_all_single)])
    dist.barrier()
    # point-to-point between two non-leaders on different hosts: a direct connection
    a, b = 1, world - 1
    if rank in (a, b):
        t = torch.full((5,), float(rank))
        if rank == a:
            dist.send(t, dst=b)
        else:
            dist.recv(t, src=a)
            if not torch.equal(t, torch.full((5,), float(a))):
                wrong.append("send/recv between non-leaders")
    dist.barrier()  # nobody leaves (closing connections) before every rank counted
    dist.destroy_process_group()
    return {"wrong": wrong, "links": links}
