"""Rank bodies for the scale tests: 16 and 32 ranks on one host or on simulated hosts.

A rank of a multi-host layout is a harness child (``tandem.testing.launch``, torch
preloaded, so dozens start in seconds) that first moves itself into its host's network
namespace with ``setns`` and takes that host's identity, then joins the group: it sees
the host's own address and loopback, and other hosts only through the lab's bridge.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Sequence

import torch

import tandem as dist
from tandem.bench._resources import snapshot
from tandem.bench._scale_failures import enter_host


def join(rank: int, world: int, store: str, names: Sequence[str], addrs: Sequence[str],
         per_host: int, timeout: float = 60.0) -> None:
    enter_host(names, addrs, rank, per_host)
    dist.init_process_group("auto", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timeout)


def _value(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s input: distinct per rank and element, exact in float32 sums."""
    return torch.arange(numel, dtype=torch.float32) % 97 + 1000 * rank


def battery(rank: int, world: int, store: str, names: Sequence[str], addrs: Sequence[str],
            per_host: int, sizes: Sequence[int]) -> dict[str, Any]:
    """Every collective against the naive oracle (each rank's input recomputed here);
    then this rank's resources and TCP connections."""
    base = snapshot()
    join(rank, world, store, names, addrs, per_host)
    wrong = []
    for numel in sizes:
        inputs = [_value(r, numel) for r in range(world)]
        total = torch.stack(inputs).sum(0)
        t = inputs[rank].clone()
        dist.all_reduce(t)
        if not torch.equal(t, total):
            wrong.append(f"all_reduce {numel}")
        outs = [torch.empty(numel) for _ in range(world)]
        dist.all_gather(outs, inputs[rank])
        if not all(torch.equal(o, i) for o, i in zip(outs, inputs)):
            wrong.append(f"all_gather {numel}")
        root = world - 1 - (numel % world)  # a root that is not rank 0
        t = inputs[rank].clone()
        dist.broadcast(t, src=root)
        if not torch.equal(t, inputs[root]):
            wrong.append(f"broadcast {numel} from {root}")
        rows = max(1, numel // world)
        full = [_value(r, rows * world) for r in range(world)]
        out = torch.empty(rows)
        dist.reduce_scatter_tensor(out, full[rank])
        want = torch.stack(full).sum(0)[rank * rows:(rank + 1) * rows]
        if not torch.equal(out, want):
            wrong.append(f"reduce_scatter {rows * world}")
        dist.barrier()
    # the watchdog starts its store thread at its first tick: counted at every layout alike
    settle = time.monotonic() + 3.0
    while time.monotonic() < settle and not any(
            t.name == "tandem-watchdog-store" for t in threading.enumerate()):
        time.sleep(0.02)
    end = snapshot()
    grown = end.minus(base)
    names = sorted(t.name for t in threading.enumerate())  # what a failed count shows
    dist.barrier()  # nobody leaves (closing connections) before every rank counted
    dist.destroy_process_group()
    return {"wrong": wrong, "thread_names": names, **grown}


def relayed(rank: int, world: int, store: str, stamp: str) -> dict[str, str]:
    """Rank 0 fails the default group and tells rank 1 only; rank 1 exits once its receive
    fails; rank 2, waiting on rank 1, returns the error it got. Rank 0 stays until then."""
    import os
    import time

    from tandem.collectives.world import default_group, world as the_world
    from tandem.errors import StateError

    join(rank, world, store, [], [], world)
    dist.barrier()
    t = torch.zeros(4)
    if rank == 0:
        the_world().transport.abort(default_group().group_id, [1],
                                    StateError("rank 0 gave up on purpose"))
        deadline = time.monotonic() + 60
        while not os.path.exists(stamp) and time.monotonic() < deadline:
            time.sleep(0.05)  # rank 2's error is written there; nothing here to wait on
        return {}
    try:
        dist.recv(t, src=0 if rank == 1 else 1)
    except Exception as exc:  # noqa: BLE001 - described for the test
        if rank == 2:
            Path(stamp).write_text("done")
        return {"type": type(exc).__name__, "msg": str(exc)}
    return {"type": "none", "msg": ""}


def relayed_script(argv: Sequence[str]) -> None:
    """:func:`relayed` as a script (``python _scale_ranks.py RANK STORE STAMP OUT``): rank
    1's news must leave at interpreter exit (atexit), not from the harness."""
    import json

    rank, store, stamp, out = int(argv[0]), argv[1], argv[2], argv[3]
    torch.set_num_threads(1)
    got = relayed(rank, 3, store, stamp)
    if rank == 1:
        raise RuntimeError(f"rank 1 stops here: {got}")  # exits without destroy
    Path(out).write_text(json.dumps(got))
    if rank == 0:
        dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    relayed_script(sys.argv[1:])
