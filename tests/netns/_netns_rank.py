"""One rank of the network-namespace tests, and the answers it must give.

Run by the test inside a namespace (``tandem.testing.netns.NetnsLab.run``)::

    ip netns exec HOST python _netns_rank.py --rank R --world P --backend auto \\
        --rendezvous file:///tmp/x/store --out /tmp/x/result-R.json [--init-only]

``--rendezvous tcp://ADDR/PORTFILE``: rank 0 serves a TCPStore on ``ADDR`` (port 0)
and writes the port to ``PORTFILE``; the others wait for the file. The rank runs
:func:`battery` (every collective and p2p pattern, with digests of the results) and
writes it as JSON to ``--out``. Inputs are small integers (products: powers of two)
in float32, so every reduction is exact in any order and :func:`expected_for`
computes the right digests from the inputs alone.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
import time
from typing import Any, Callable

import torch

SIZES = (1, 1001, 100003)  # 1001, 100003: divisible by neither 2, 3 nor 4 ranks
BIG = (3 << 20) + 5  # floats: larger than any ring chunk
FLOAT_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")
INT_OPS = ("SUM", "BAND", "BOR", "BXOR")
SUBGROUP = [1, 2, 3]
_COMBINE: dict[str, Callable[..., torch.Tensor]] = {
    "SUM": torch.add, "AVG": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum,
    "MAX": torch.maximum, "BAND": torch.bitwise_and, "BOR": torch.bitwise_or,
    "BXOR": torch.bitwise_xor,
}


def inp(op: str, seed: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.int64)
    if dtype == torch.int64:
        return (i * 2654435761 + seed * 40503) % (1 << 40) * (1 if seed % 2 else -1)
    if op == "PRODUCT":
        return torch.tensor([0.5, 1.0, 2.0], dtype=dtype)[(i * 5 + seed) % 3]
    return ((i * 7 + seed) % 23).to(dtype)


def digest(t: torch.Tensor | list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for part in t if isinstance(t, list) else [t]:
        h.update(part.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _reduce(op: str, parts: list[torch.Tensor]) -> torch.Tensor:
    out = functools.reduce(_COMBINE[op], parts)
    return out / len(parts) if op == "AVG" else out


def _all_reduce_cases() -> list[tuple[str, torch.dtype, int]]:
    cases = [("SUM", torch.float32, n) for n in (*SIZES, BIG)]
    cases += [(op, torch.float32, 1001) for op in FLOAT_OPS if op != "SUM"]
    cases += [(op, torch.int64, 1001) for op in INT_OPS]
    return cases


def _key(op: str, dtype: torch.dtype, n: int) -> str:
    return f"all_reduce/{op}/{str(dtype).removeprefix('torch.')}/{n}"


def _broadcasts(p: int) -> list[int]:
    return sorted({0, 1, p - 1})


@functools.lru_cache(maxsize=None)
def _same_on_every_rank(p: int) -> dict[str, str]:
    # computed once per world size: it was most of the checking's 2.4 s of CPU, per rank
    out = {}
    for op, dtype, n in _all_reduce_cases():
        out[_key(op, dtype, n)] = digest(_reduce(op, [inp(op, r, n, dtype) for r in range(p)]))
    out["all_reduce_naive/100003"] = out[_key("SUM", torch.float32, 100003)]
    for src in _broadcasts(p):
        for n in SIZES:
            out[f"broadcast/{src}/{n}"] = digest(inp("SUM", 100 + src, n))
            out[f"hierarchical_broadcast/{src}/{n}"] = digest(inp("SUM", 200 + src, n))
    out["all_gather"] = digest([inp("SUM", 300 + r, 1001) for r in range(p)])
    return out


def expected_for(rank: int, p: int) -> dict[str, str]:
    """The digests rank ``rank`` of ``p`` must report, from the inputs alone."""
    out = dict(_same_on_every_rank(p))
    n, prv = 1001, (rank - 1) % p
    out["reduce_scatter"] = digest(_reduce("SUM", [inp("SUM", s * p + rank, n) for s in range(p)]))
    out["all_to_all"] = digest([inp("SUM", j * 100 + rank, n) for j in range(p)])
    out["send_recv"] = digest(inp("SUM", 400 + prv, 100003))
    out["isend_irecv"] = digest(inp("SUM", 500 + prv, 100003))
    if rank in SUBGROUP:
        out["subgroup_all_reduce"] = digest(_reduce("SUM", [inp("SUM", r, n) for r in SUBGROUP]))
    out["barrier"] = "passed"
    return out


def battery(rank: int, p: int) -> dict[str, Any]:
    import tandem as dist
    from tandem.collectives import algorithms as algo
    from tandem.collectives.world import default_group, world

    group = default_group()
    transport = world().transport
    shm = getattr(transport, "shm", transport if type(transport).__name__ == "ShmTransport"
                  else None)
    out: dict[str, Any] = {
        "transport": type(transport).__name__,
        "host_of": [transport.host_of(r) for r in range(p)],
        "shm_peers": [r for r in range(p) if r != rank and shm is not None and shm.reaches(r)],
        "chosen": [algo.select_all_reduce(group, torch.zeros(n))[0] for n in (1, BIG)],
    }
    for op, dtype, n in _all_reduce_cases():
        t = inp(op, rank, n, dtype)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[_key(op, dtype, n)] = digest(t)
    group.algorithm_override["all_reduce"] = "naive"
    t = inp("SUM", rank, 100003)
    dist.all_reduce(t)
    out["all_reduce_naive/100003"] = digest(t)
    group.algorithm_override.clear()
    for src in _broadcasts(p):
        for n in SIZES:
            t = inp("SUM", 100 + src, n) if rank == src else torch.zeros(n)
            dist.broadcast(t, src=src)
            out[f"broadcast/{src}/{n}"] = digest(t)
            t = inp("SUM", 200 + src, n) if rank == src else torch.zeros(n)
            op = group.new_op("hierarchical_broadcast", f"hbroadcast {n} {src}", "netns")
            group.run(op, lambda o, t=t, src=src: algo.hierarchical_broadcast(o, t, src), False)
            out[f"hierarchical_broadcast/{src}/{n}"] = digest(t)
    n = 1001
    outs = [torch.empty(n) for _ in range(p)]
    dist.all_gather(outs, inp("SUM", 300 + rank, n))
    out["all_gather"] = digest(outs)
    res = torch.empty(n)
    dist.reduce_scatter(res, [inp("SUM", rank * p + j, n) for j in range(p)])
    out["reduce_scatter"] = digest(res)
    outs = [torch.empty(n) for _ in range(p)]
    dist.all_to_all(outs, [inp("SUM", rank * 100 + j, n) for j in range(p)])
    out["all_to_all"] = digest(outs)
    nxt, prv, got = (rank + 1) % p, (rank - 1) % p, torch.empty(100003)
    if rank % 2 == 0:
        dist.send(inp("SUM", 400 + rank, 100003), dst=nxt)
        dist.recv(got, src=prv)
    else:
        dist.recv(got, src=prv)
        dist.send(inp("SUM", 400 + rank, 100003), dst=nxt)
    out["send_recv"] = digest(got)
    works = [dist.isend(inp("SUM", 500 + rank, 100003), dst=nxt), dist.irecv(got, src=prv)]
    for w in works:
        w.wait()
    out["isend_irecv"] = digest(got)
    sub = dist.new_group(SUBGROUP)
    if rank in SUBGROUP:
        t = inp("SUM", rank, n)
        out["subgroup_chosen"] = algo.select_all_reduce(sub, t)[0]
        dist.all_reduce(t, group=sub)
        out["subgroup_all_reduce"] = digest(t)
    dist.barrier()
    out["barrier"] = "passed"
    return out


def _store(spec: str, rank: int, p: int) -> Any:
    import tandem as dist

    if spec.startswith("file://"):
        return dist.FileStore(spec.removeprefix("file://"), p)
    addr, _, portfile = spec.removeprefix("tcp://").partition("/")
    portfile = "/" + portfile
    if rank == 0:
        store = dist.TCPStore(addr, 0, p, is_master=True, wait_for_workers=False, timeout=60)
        with open(portfile + ".tmp", "w") as f:
            f.write(str(store.port))
        os.rename(portfile + ".tmp", portfile)
        return store
    deadline = time.monotonic() + 60
    while not os.path.exists(portfile):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no store port in {portfile}")
        time.sleep(0.05)
    with open(portfile) as f:
        return dist.TCPStore(addr, int(f.read()), p, timeout=60)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--rendezvous", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--init-only", action="store_true")
    a = parser.parse_args(argv)
    torch.set_num_threads(1)
    import tandem as dist

    store = _store(a.rendezvous, a.rank, a.world)
    dist.init_process_group(a.backend, store=store, rank=a.rank, world_size=a.world, timeout=60)
    try:
        result = {"init": "ok"} if a.init_only else battery(a.rank, a.world)
    finally:
        dist.destroy_process_group()
    with open(a.out + ".tmp", "w") as f:
        json.dump(result, f)
    os.rename(a.out + ".tmp", a.out)


if __name__ == "__main__":
    main(sys.argv[1:])
