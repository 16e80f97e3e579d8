"""A custom all_reduce algorithm, registered and checked against the naive oracle.

Run it (2 local processes by default, or N with an argument)::

    python examples/custom_algorithm.py        # 2 ranks
    python examples/custom_algorithm.py 3      # 3 ranks

An algorithm is a function ``fn(op, buf, redop)`` that leaves the reduction of every
rank's flat, contiguous ``buf`` in ``buf`` on every rank. It talks to peers only
through ``op.send(peer, step, view)``, ``op.recv(peer, step, view)`` and
``op.wait(*handles)`` (peers by group rank; ``step`` tells the messages of one call
apart), so it runs over any backend, with the op's deadline, dead-peer detection and
signature checks for free. ``tandem.register_algorithm("all_reduce", name, fn)`` makes
it selectable per group (``group.algorithm_override["all_reduce"] = name``) or for the
whole job (``TANDEM_ALGORITHM=name``); every rank must register it and pick it.

The algorithm here, "all_pairs", is the one-round opposite of the ring: every rank
sends its whole buffer to every other rank and reduces all of them locally. That is
one message latency but ``p - 1`` times the data, so it only pays for tiny tensors.
Because every rank combines the buffers in rank order, exactly as the naive oracle
does, the results are bit-identical to the oracle even for random floats.
"""

from __future__ import annotations

import sys

import torch

import tandem
from tandem.collectives.group import Op, as_bytes
from tandem.collectives.reduce_op import combine, finish
from tandem.testing import spawn


def all_pairs_all_reduce(op: Op, buf: torch.Tensor, redop: tandem.ReduceOp) -> None:
    g = op.group
    p, r = g.group_size, g.group_rank
    parts = [buf if i == r else torch.empty_like(buf) for i in range(p)]
    recvs = [op.recv(i, 0, as_bytes(parts[i])) for i in range(p) if i != r]  # post first:
    sends = [op.send(i, 0, as_bytes(buf)) for i in range(p) if i != r]      # zero-copy recv
    op.wait(*recvs, *sends)
    acc = parts[0].clone()
    for t in parts[1:]:
        combine(redop, acc, t, acc)  # lower rank's data first, as the oracle does
    finish(redop, acc, p)  # AVG divides here
    buf.copy_(acc)


def worker(rank: int, world_size: int) -> dict[str, bool]:
    tandem.register_algorithm("all_reduce", "all_pairs", all_pairs_all_reduce)
    group = tandem.new_group()  # every rank; a group of our own to choose algorithms on
    assert isinstance(group, tandem.ProcessGroup)
    g = torch.Generator().manual_seed(rank)
    inputs = {
        "SUM float32": (torch.randn(10_000, generator=g), tandem.ReduceOp.SUM),
        "AVG float64": (torch.randn(999, generator=g, dtype=torch.float64), tandem.ReduceOp.AVG),
        "MAX int64": (torch.randint(-1000, 1000, (77,), generator=g), tandem.ReduceOp.MAX),
        "SUM empty": (torch.empty(0), tandem.ReduceOp.SUM),
    }
    agree = {}
    for name, (x, redop) in inputs.items():
        out = {}
        for algorithm in ("all_pairs", "naive"):
            group.algorithm_override["all_reduce"] = algorithm
            t = x.clone()
            tandem.all_reduce(t, op=redop, group=group)
            out[algorithm] = t
        agree[name] = torch.equal(out["all_pairs"], out["naive"])
    return agree


def main(world_size: int = 2) -> list[dict[str, bool]]:
    results = spawn(world_size, worker, timeout=120)
    for rank, agree in enumerate(results):
        for name, same in agree.items():
            print(f"rank {rank}: all_pairs {'==' if same else '!='} naive for {name}")
    assert all(all(agree.values()) for agree in results), "all_pairs disagrees with naive"
    print("custom algorithm OK")
    return results


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
