"""The call parts of ``python -m tandem.bench torch-backend``: single collectives through
torch's API on each group, and what torch's layer adds to a call.

* ``all_reduce``: ``torch.distributed.all_reduce(t)`` on each group, float32, after a
  check on known values. The third contender, "tandem direct", calls
  ``tandem.all_reduce(t, group=...)`` on the very tandem group under the torch one:
  the torch layer (torch's Python API and tandem's process-group adapter) is then
  the only difference.
* ``coalesced``: torch's ``_coalescing_manager`` around 8 ``all_gather_single`` calls
  of 4 KB each (one coalesced call to the group, as functional collectives make too).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Sequence

import torch

from tandem.bench.collectives import _fmt_size
from tandem.bench.torch_backend_rounds import Contender, agreed_iters, best_rounds

__all__ = ["all_reduce_part", "coalesced_part", "layer_cost_seconds"]


def all_reduce_part(gloo: Any, rank: int, world: int, sizes: Sequence[int], rounds: int,
                     round_s: float) -> list[dict[str, Any]]:
    import torch.distributed as dist

    import tandem

    direct = dist.group.WORLD.tandem_group  # type: ignore[union-attr]
    out = []
    for size in sizes:
        numel = max(1, size // 4)
        calls = {"tandem": lambda t: dist.all_reduce(t),
                 "gloo": lambda t: dist.all_reduce(t, group=gloo),
                 "tandem direct": lambda t: tandem.all_reduce(t, group=direct)}
        for name, call in calls.items():  # the check is also the warm-up
            t = torch.full((numel,), float(rank + 1))
            call(t)
            if not torch.equal(t, torch.full((numel,), float(world * (world + 1) // 2))):
                raise AssertionError(f"{name} all_reduce of {size} bytes is wrong on rank {rank}")
        buf = torch.zeros(numel)
        barriers = {"tandem": dist.barrier, "gloo": lambda: dist.barrier(group=gloo),
                    "tandem direct": lambda: tandem.barrier(group=direct)}
        contenders: dict[str, Contender] = {
            n: (barriers[n], functools.partial(c, buf)) for n, c in calls.items()}
        iters = agreed_iters(contenders, gloo, round_s, 4000)
        out.append({"part": "all_reduce", "what": _fmt_size(size),
                    "times": best_rounds(contenders, iters, rounds)})
    return out


def coalesced_part(gloo: Any, rank: int, world: int, rounds: int,
                    round_s: float) -> list[dict[str, Any]]:
    import torch.distributed as dist

    count, numel = 8, 1024
    ins = [torch.full((numel,), float(rank + 1)) for _ in range(count)]
    outs = [torch.empty(numel * world) for _ in range(count)]
    expected = torch.arange(1.0, world + 1).repeat_interleave(numel)

    def gather(group: Any) -> Callable[[], None]:
        def step() -> None:
            with dist._coalescing_manager(group=group):
                for out, inp in zip(outs, ins):
                    dist.all_gather_single(out, inp, group=group)
        return step

    steps = {"tandem": gather(None), "gloo": gather(gloo)}
    for name, step in steps.items():  # the check is also the warm-up
        for out in outs:
            out.zero_()
        step()
        if not all(torch.equal(out, expected) for out in outs):
            raise AssertionError(f"{name} coalesced all_gather is wrong on rank {rank}")
    barriers = {"tandem": dist.barrier, "gloo": lambda: dist.barrier(group=gloo)}
    contenders: dict[str, Contender] = {
        n: (barriers[n], s) for n, s in steps.items()}
    iters = agreed_iters(contenders, gloo, round_s, 2000)
    return [{"part": "coalesced", "what": f"{count} x {_fmt_size(numel * 4)} all_gather",
             "times": best_rounds(contenders, iters, rounds)}]


def layer_cost_seconds(numel: int = 1024, number: int = 100, repeat: int = 150) -> float:
    """What torch's API and tandem's adapter add per all_reduce call, timed in this process.

    On a one-rank "tandem" group no data moves, so ``torch.distributed.all_reduce`` and
    ``tandem.all_reduce`` on the group underneath differ only by the torch layer. The
    two alternate, each keeps its best repeat, and the clock is CPU time: on a shared,
    oversubscribed machine wall time stretches with every other process's share of the
    CPU, where CPU time counts only the work done. Repeats are short and many: CPU time
    too grows when other jobs share the core's caches, and a short repeat more often
    falls in a quiet stretch (measured at load 12-22, three runs each: 150 repeats of
    100 calls gave 7.2-9.9 us, 15 of 2,000 gave 7.8-11.8 us for the same code).
    """
    import timeit

    import torch.distributed as dist

    import tandem
    import tandem.torch_backend  # noqa: F401 - registers "tandem"

    dist.init_process_group("tandem", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD.tandem_group  # type: ignore[union-attr]
        t = torch.zeros(numel)
        best = {"torch": float("inf"), "direct": float("inf")}
        calls = {"torch": lambda: dist.all_reduce(t),
                 "direct": lambda: tandem.all_reduce(t, group=group)}
        for _ in range(repeat):
            for name, call in calls.items():
                clock = timeit.Timer(call, timer=time.process_time)
                best[name] = min(best[name], clock.timeit(number=number) / number)
        return best["torch"] - best["direct"]
    finally:
        dist.destroy_process_group()
