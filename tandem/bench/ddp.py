"""DistributedDataParallel step time and peak memory: tandem against torch (gloo).

Run from the repository root with the project's interpreter::

    python -m tandem.bench ddp                 # both models, 2 ranks: ~1 min on 2 cores
    python -m tandem.bench ddp --quick         # a few steps, seconds; what a smoke test runs
    python -m tandem.bench ddp --models mlp --rounds 9 --markdown
    python -m tandem.bench.ddp ...             # the same, without the dispatcher

Models (batch 32 per rank, SGD, one torch thread per rank):

* ``mlp``  communication-bound: 8 x Linear(1024, 1024) with ReLU, 8.4 M parameters
  (32 MiB of gradients per step);
* ``cnn``  compute-bound: four 3x3 convolutions on 32x32 images, 0.1 M parameters.

How it measures. Each library trains in its own set of rank processes (tandem
"tcp" with a FileStore rendezvous, or gloo with file://), so each process's
``ru_maxrss`` belongs to one library. After the process group, model, optimizer and
one local forward/backward exist, the rank notes its ``ru_maxrss``; then it wraps the
model in DDP, warms up, and runs rounds of ``--steps`` steps, each round after a
barrier. A round's time per step is the slowest rank's; the table shows the best
round. "peak" is the growth of ``ru_maxrss`` from that mark to the end (buckets,
communication buffers, allocator slack), the largest over the ranks. The libraries
take turns (tandem, torch, then torch, tandem when ``--passes 2``) and the best
pass counts, so both see the same machine noise.

ratio = torch step time / tandem step time: above 1 means tandem is faster.
mem ratio = torch peak / tandem peak: above 1 means tandem uses less memory.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import socket
import sys
import tempfile
import time
from typing import Any, Sequence

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["main", "run"]

MODELS = ("mlp", "cnn")
LIBS = ("tandem", "torch")
BATCH = 32
_TIMEOUT_S = 300.0


def build(model: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model and one batch of inputs and targets."""
    torch.manual_seed(0)
    if model == "mlp":
        layers: list[nn.Module] = []
        for _ in range(8):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        return nn.Sequential(*layers), torch.randn(BATCH, 1024), torch.randn(BATCH, 1024)
    net = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, 10))
    return net, torch.randn(BATCH, 3, 32, 32), torch.randn(BATCH, 10)


def _maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


# ---- inside each rank process ---------------------------------------------------------


def _rank_main(rank: int, world: int, lib: str, url: str, model_name: str, warmup: int,
               steps: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    if lib == "tandem":
        import tandem as dist
        from tandem.parallel.ddp import DistributedDataParallel as DDP

        dist.init_process_group("tcp", init_method=url, rank=rank, world_size=world,
                                timeout=_TIMEOUT_S)
    else:
        import torch.distributed as dist  # type: ignore[no-redef]
        from torch.nn.parallel import DistributedDataParallel as DDP  # type: ignore[assignment]

        dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=_TIMEOUT_S))
    try:
        model, x, y = build(model_name)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        F.mse_loss(model(x), y).backward()  # grads and autograd workspace exist now
        opt.zero_grad()
        base = _maxrss_bytes()
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)

        def step() -> None:
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            opt.step()

        for _ in range(warmup):
            step()
        times = []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            times.append((time.perf_counter() - start) / steps)
        out: dict[str, Any] = {"times": times, "peak": _maxrss_bytes() - base,
                               "params": sum(p.numel() for p in model.parameters())}
        stats = getattr(ddp, "stats", None)
        if stats is not None:
            mean = stats.mean
            out.update(comm=mean.comm_s, overlap=mean.overlap_s, buckets=mean.buckets)
        return out
    finally:
        dist.destroy_process_group()


# ---- in the parent --------------------------------------------------------------------


def _one(lib: str, model: str, world: int, warmup: int, steps: int, rounds: int,
         timeout: float) -> dict[str, Any]:
    from tandem.testing import spawn

    env = {}
    if any(name == "lo" for _, name in socket.if_nameindex()):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo would otherwise pick the hostname's interface
    with tempfile.TemporaryDirectory(prefix="tandem-bench-ddp-") as tmp:
        per_rank = spawn(world, _rank_main, (lib, f"file://{tmp}/store", model, warmup, steps,
                                             rounds), init=False, timeout=timeout, env=env)
    best = min(max(r["times"][i] for r in per_rank) for i in range(rounds))
    out = dict(per_rank[0])
    out.update(step=best, peak=max(r["peak"] for r in per_rank))
    return out


def run(models: Sequence[str], world: int = 2, *, warmup: int = 3, steps: int = 10,
        rounds: int = 5, passes: int = 2, timeout: float = 600.0) -> list[dict[str, Any]]:
    """One row per model: best step time and peak memory of each library."""
    rows = []
    for model in models:
        found: dict[str, dict[str, Any]] = {}
        for p in range(passes):
            for lib in (LIBS if p % 2 == 0 else LIBS[::-1]):
                got = _one(lib, model, world, warmup, steps, rounds, timeout)
                if lib not in found or got["step"] < found[lib]["step"]:
                    peak = min(got["peak"], found[lib]["peak"]) if lib in found else got["peak"]
                    found[lib] = {**got, "peak": peak}
                elif got["peak"] < found[lib]["peak"]:
                    found[lib]["peak"] = got["peak"]
        rows.append({"model": model, "world": world, **{lib: found[lib] for lib in LIBS}})
    return rows


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


_HEADER = ("model", "ranks", "params", "tandem step", "torch step", "ratio", "tandem peak",
           "torch peak", "mem ratio", "tandem comm (overlapped)")


def _cells(row: dict[str, Any]) -> list[str]:
    t, g = row["tandem"], row["torch"]
    mem = f"{g['peak'] / t['peak']:.2f}" if t["peak"] > 0 else "-"
    return [row["model"], str(row["world"]), f"{t['params'] / 1e6:.2f} M", _ms(t["step"]),
            _ms(g["step"]), f"{g['step'] / t['step']:.2f}", _mb(t["peak"]), _mb(g["peak"]),
            mem, f"{_ms(t.get('comm', 0.0))} ({_ms(t.get('overlap', 0.0))})"]


def format_table(rows: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    body = [_cells(r) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(_HEADER) + " |",
                 "|" + "|".join([":---"] + ["---:"] * (len(_HEADER) - 1)) + "|"]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in body])
    widths = [max(len(x) for x in col) for col in zip(_HEADER, *body)]
    return "\n".join("  ".join([c.ljust(w) if i == 0 else c.rjust(w)
                                for i, (c, w) in enumerate(zip(cells, widths))])
                     for cells in [list(_HEADER), *body])


def machine() -> str:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f
                          if ln.startswith("model name")), model)
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{model or platform.machine()}, {os.cpu_count()} CPUs ({usable} usable), "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench ddp",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma list of {', '.join(MODELS)} (default: both)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--steps", type=int, default=10, help="steps per round (default 10)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per pass (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (default 3)")
    parser.add_argument("--passes", type=int, default=2,
                        help="times each library runs, alternating (default 2)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="deadline per library and model, seconds (default 600)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1 pass, 2 rounds of 3 steps after 1 warm-up step")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown or not models:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    if args.world_size < 2 or min(args.steps, args.rounds, args.passes) < 1 or args.warmup < 0:
        parser.error("need --world-size >= 2, --steps/--rounds/--passes >= 1, --warmup >= 0")
    warmup, steps, rounds, passes = args.warmup, args.steps, args.rounds, args.passes
    if args.quick:
        warmup, steps, rounds, passes = 1, 3, 2, 1
    start = time.monotonic()
    rows = run(models, args.world_size, warmup=warmup, steps=steps, rounds=rounds,
               passes=passes, timeout=args.timeout)
    print(f"machine: {machine()}")
    print(f"DDP: tandem 'tcp' vs torch 'gloo', {args.world_size} ranks on loopback, batch "
          f"{BATCH}/rank, 1 thread/rank; best of {rounds} rounds x {steps} steps, {passes} "
          f"pass(es); ratio = torch/tandem step time (>1: tandem faster); mem ratio = "
          f"torch/tandem ru_maxrss growth; {time.monotonic() - start:.0f} s")
    print(format_table(rows, markdown=args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
