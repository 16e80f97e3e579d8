"""Unmodified torch code over the "tandem" backend against the same code over gloo.

Run::

    python -m tandem.bench torch-backend               # 2 ranks: all_reduce, DDP, FSDP2 (~3 min)
    python -m tandem.bench torch-backend --sizes 4K,64M --parts all_reduce
    python -m tandem.bench torch-backend --markdown    # the table for the README
    python -m tandem.bench torch-backend --quick       # seconds; what the smoke test runs

How it measures. One set of rank processes joins torch.distributed with the backend
"tandem" (the default group) and builds a gloo group over the same ranks; every
contender runs torch's own code on one of the two groups, so the library under
torch's API is the only difference:

* ``all_reduce``: ``torch.distributed.all_reduce(t)`` on each group, float32, after a
  check on known values. The third contender, "tandem direct", calls
  ``tandem.all_reduce(t, group=...)`` on the very tandem group under the torch one:
  the torch layer (torch's Python API and tandem's process-group adapter) is then
  the only difference, and "torch layer" is its cost, tandem via torch / direct - 1.
* ``coalesced``: torch's ``_coalescing_manager`` around 8 ``all_gather_single`` calls
  of 4 KB each (one coalesced call to the group, as functional collectives make too).
* ``ddp``: a step (forward, backward, SGD) of torch's DistributedDataParallel on the
  8.4 M-parameter MLP of ``python -m tandem.bench ddp``, batch 32 per rank.
* ``fsdp``: a step of torch's FSDP2 (``fully_shard`` per layer and at the root, Adam)
  on a small transformer (4 layers, width 256, 2.6 M parameters), batch 8 x 64 tokens.

Rounds rotate through the contenders, each round after a barrier, so all see the
same machine noise; a round lasts as long as its slowest rank and a contender's
figure is its best round. "speed-up" = gloo's wall time / tandem's (above 1: tandem
is faster; 4 KB latency 0.3x = speed-up 3.3). "torch layer" is given in wall time
and in CPU time per call (each rank process's, every thread; the best round of the
slowest rank): when more processes want the CPUs than there are, wall time also
measures who got scheduled, CPU time only the work done.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import socket
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from tandem.bench.collectives import _fmt_size, machine, parse_sizes

__all__ = ["main", "run", "format_table", "TinyTransformer"]

PARTS = ("all_reduce", "coalesced", "ddp", "fsdp")
CLOCKS = ("wall", "cpu")
_TIMEOUT_S = 300.0


class TinyTransformer(nn.Module):
    """Embedding, ``layers`` transformer encoder layers, output projection."""

    def __init__(self, vocab: int = 1024, width: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
            for _ in range(layers))
        self.out = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


# ---- inside each rank process ---------------------------------------------------------


def _best_rounds(contenders: dict[str, tuple[Callable[[], object], Callable[[], object]]],
                 iters: dict[str, int], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per clock ("wall", "cpu": this process's CPU time, every thread) and contender,
    seconds per iteration in each round; the order of the contenders rotates per round."""
    names = list(contenders)
    times: dict[str, dict[str, list[float]]] = {c: {n: [] for n in names} for c in CLOCKS}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            barrier, step = contenders[name]
            barrier()
            start, used = time.perf_counter(), time.process_time()
            for _ in range(iters[name]):
                step()
            times["wall"][name].append((time.perf_counter() - start) / iters[name])
            times["cpu"][name].append((time.process_time() - used) / iters[name])
    return times


def _agreed_iters(contenders: dict[str, Any], gloo: Any, round_s: float,
                  cap: int) -> dict[str, int]:
    """Iterations per round for each contender; every rank must run the same count."""
    import torch.distributed as dist

    est = []
    for barrier, step in contenders.values():
        barrier()
        start = time.perf_counter()
        step()
        est.append(time.perf_counter() - start)
    agreed = torch.tensor(est, dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=gloo)
    return {n: max(1, min(cap, int(round_s / max(e, 1e-9))))
            for n, e in zip(contenders, agreed.tolist())}


def _all_reduce_part(gloo: Any, rank: int, world: int, sizes: Sequence[int], rounds: int,
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
        contenders: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
            n: (barriers[n], functools.partial(c, buf)) for n, c in calls.items()}
        iters = _agreed_iters(contenders, gloo, round_s, 4000)
        out.append({"part": "all_reduce", "what": _fmt_size(size),
                    "times": _best_rounds(contenders, iters, rounds)})
    return out


def _coalesced_part(gloo: Any, rank: int, world: int, rounds: int,
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
    contenders: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        n: (barriers[n], s) for n, s in steps.items()}
    iters = _agreed_iters(contenders, gloo, round_s, 2000)
    return [{"part": "coalesced", "what": f"{count} x {_fmt_size(numel * 4)} all_gather",
             "times": _best_rounds(contenders, iters, rounds)}]


def _trainers(model: nn.Module, wrap: Callable[[nn.Module], nn.Module], data: Any,
              loss: Callable[[nn.Module, Any], torch.Tensor],
              optimizer: Callable[[Any], torch.optim.Optimizer]) -> Callable[[], object]:
    wrapped = wrap(model)
    opt = optimizer(wrapped.parameters())

    def step() -> None:
        opt.zero_grad()
        loss(wrapped, data).backward()
        opt.step()

    return step


def _steps_part(part: str, gloo: Any, rank: int, world: int, warmup: int, steps: int,
                rounds: int, small: bool) -> list[dict[str, Any]]:
    import torch.distributed as dist

    if part == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        from tandem.bench.ddp import build

        model, x, y = build("cnn" if small else "mlp")
        wraps: dict[str, Callable[[nn.Module], nn.Module]] = {
            "tandem": lambda m: DDP(m), "gloo": lambda m: DDP(m, process_group=gloo)}
        data: Any = (x, y)
        params = sum(p.numel() for p in model.parameters())
        what = f"{'cnn' if small else 'mlp'}, {params / 1e6:.1f} M params"

        def loss(m: nn.Module, d: Any) -> torch.Tensor:
            return F.mse_loss(m(d[0]), d[1])

        def optimizer(params: Any) -> torch.optim.Optimizer:
            return torch.optim.SGD(params, lr=1e-4)
    else:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = TinyTransformer(width=64, layers=1) if small else TinyTransformer()
        meshes = {"tandem": init_device_mesh("cpu", (world,)),
                  "gloo": DeviceMesh.from_group(gloo, "cpu")}

        def shard(mesh: Any) -> Callable[[nn.Module], nn.Module]:
            def wrap(m: nn.Module) -> nn.Module:
                for layer in m.layers:  # type: ignore[union-attr]
                    fully_shard(layer, mesh=mesh)
                fully_shard(m, mesh=mesh)
                return m
            return wrap

        wraps = {n: shard(mesh) for n, mesh in meshes.items()}
        data = torch.randint(0, model.vocab, (8, 65), generator=torch.Generator().manual_seed(rank))
        what = f"transformer, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params"

        def loss(m: nn.Module, d: Any) -> torch.Tensor:
            logits = m(d[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), d[:, 1:].reshape(-1))

        def optimizer(params: Any) -> torch.optim.Optimizer:
            return torch.optim.Adam(params, lr=1e-4)

    steppers = {n: _trainers(copy.deepcopy(model), wrap, data, loss, optimizer)
                for n, wrap in wraps.items()}
    for step in steppers.values():
        for _ in range(warmup):
            step()
    barriers = {"tandem": dist.barrier, "gloo": lambda: dist.barrier(group=gloo)}
    contenders = {n: (barriers[n], s) for n, s in steppers.items()}
    return [{"part": part, "what": what,
             "times": _best_rounds(contenders, {n: steps for n in contenders}, rounds)}]


def _rank_main(rank: int, world: int, tmp: str, parts: Sequence[str], sizes: Sequence[int],
               rounds: int, round_s: float, warmup: int, steps: int,
               small: bool) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    import torch.distributed as dist

    import tandem.torch_backend  # noqa: F401 - registers "tandem"

    dist.init_process_group("tandem", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=_TIMEOUT_S))
    try:
        gloo = dist.new_group(backend="gloo")
        rows: list[dict[str, Any]] = []
        if "all_reduce" in parts:
            rows += _all_reduce_part(gloo, rank, world, sizes, rounds, round_s)
        if "coalesced" in parts:
            rows += _coalesced_part(gloo, rank, world, rounds, round_s)
        for part in ("ddp", "fsdp"):
            if part in parts:
                rows += _steps_part(part, gloo, rank, world, warmup, steps, rounds, small)
        return rows
    finally:
        dist.destroy_process_group()


# ---- in the parent --------------------------------------------------------------------


def layer_cost_seconds(numel: int = 1024, number: int = 2000, repeat: int = 15) -> float:
    """What torch's API and tandem's adapter add per all_reduce call, timed in this process.

    On a one-rank "tandem" group no data moves, so ``torch.distributed.all_reduce`` and
    ``tandem.all_reduce`` on the group underneath differ only by the torch layer. The
    two alternate, each keeps its best repeat, and the clock is CPU time: on a shared,
    oversubscribed machine wall time stretches with every other process's share of the
    CPU, where CPU time counts only the work done.
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


def run(world: int, parts: Sequence[str], sizes: Sequence[int], *, rounds: int = 7,
        round_s: float = 0.07, warmup: int = 2, steps: int = 5, small: bool = False,
        timeout: float = 900.0) -> list[dict[str, Any]]:
    """One row per (part, size or model): each contender's best seconds per op or step.

    ``small`` swaps the models for tiny ones (the CNN of the ddp benchmark, a one-layer
    transformer): a smoke run of the code, not a measurement.
    """
    from tandem.testing import spawn

    env = {"GLOO_SOCKET_IFNAME": "lo"} if any(
        name == "lo" for _, name in socket.if_nameindex()) else {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-torch-") as tmp:
        per_rank = spawn(world, _rank_main,
                         (tmp, parts, sizes, rounds, round_s, warmup, steps, small),
                         init=False, timeout=timeout, env=env)
    rows = []
    for i, row in enumerate(per_rank[0]):
        # per clock: a round counts as its slowest rank; keep the best round
        best = {c: {n: min(max(r[i]["times"][c][n][k] for r in per_rank) for k in range(rounds))
                    for n in row["times"][c]} for c in CLOCKS}
        rows.append({"part": row["part"], "what": row["what"], "world": world, **best})
    return rows


def _time(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


_HEADER = ("ranks", "measure", "size / model", "gloo", "tandem", "speed-up", "tandem direct",
           "torch layer")


def _cells(row: dict[str, Any]) -> list[str]:
    wall, cpu = row["wall"], row["cpu"]
    direct = wall.get("tandem direct")
    layer = "-"
    if direct:
        layer = (f"{(wall['tandem'] / direct - 1) * 100:+.1f}% "
                 f"(CPU {(cpu['tandem'] / cpu['tandem direct'] - 1) * 100:+.1f}%)")
    measure = row["part"] if row["part"] in ("all_reduce", "coalesced") else f"{row['part']} step"
    return [str(row["world"]), measure, row["what"], _time(wall["gloo"]), _time(wall["tandem"]),
            f"{wall['gloo'] / wall['tandem']:.2f}", _time(direct) if direct else "-", layer]


def format_table(rows: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    body = [_cells(r) for r in rows]
    text = [False, False, False] + [True] * (len(_HEADER) - 3)
    if markdown:
        lines = ["| " + " | ".join(_HEADER) + " |",
                 "|" + "|".join("---:" if n else ":---" for n in text) + "|"]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in body])
    widths = [max(len(x) for x in col) for col in zip(_HEADER, *body)]
    return "\n".join("  ".join(c.rjust(w) if n else c.ljust(w)
                               for c, w, n in zip(cells, widths, text))
                     for cells in [list(_HEADER), *body])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench torch-backend",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma list of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("4K,64K,1M,16M,64M"),
                        help="all_reduce bytes per rank, comma list (default 4K,64K,1M,16M,64M)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per contender (default 7)")
    parser.add_argument("--round-ms", type=float, default=70.0,
                        help="length of an all_reduce round (default 70)")
    parser.add_argument("--steps", type=int, default=5,
                        help="training steps per round (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (default 2)")
    parser.add_argument("--timeout", type=float, default=900.0, help="deadline, seconds")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 4 KB, tiny models, 2 short rounds, 1 step per round")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    if args.world_size < 2 or min(args.rounds, args.steps) < 1 or args.warmup < 0:
        parser.error("need --world-size >= 2, --rounds/--steps >= 1, --warmup >= 0")
    sizes, rounds, round_s = args.sizes, args.rounds, args.round_ms / 1e3
    warmup, steps = args.warmup, args.steps
    if args.quick:
        sizes, rounds, round_s, warmup, steps = [4 << 10], 2, 0.02, 1, 1
    start = time.monotonic()
    rows = run(args.world_size, parts, sizes, rounds=rounds, round_s=round_s, warmup=warmup,
               steps=steps, small=args.quick, timeout=args.timeout)
    print(f"machine: {machine()}")
    print(f"torch.distributed with backend 'tandem' vs 'gloo', {args.world_size} ranks on one "
          f"host, 1 thread/rank; best of {rounds} rounds; speed-up = gloo/tandem wall time; "
          f"torch layer = tandem via torch / tandem direct - 1 in wall (and CPU) time; "
          f"{time.monotonic() - start:.0f} s")
    print(format_table(rows, markdown=args.markdown))
    direct = next((r["cpu"]["tandem direct"] for r in rows
                   if r["part"] == "all_reduce" and r["what"] == "4 KB"), None)
    if direct is not None:
        cost = layer_cost_seconds(number=200 if args.quick else 2000,
                                  repeat=3 if args.quick else 15)
        print(f"torch layer per call (CPU time, one process, best of alternating repeats): "
              f"{cost * 1e6:.1f} us = {cost / direct * 100:.1f}% of the CPU time of a 4 KB "
              f"tandem direct all_reduce above")
    return 0


if __name__ == "__main__":
    sys.exit(main())
