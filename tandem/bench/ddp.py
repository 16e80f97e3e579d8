"""DistributedDataParallel step time and peak memory: tandem against torch (gloo).

Run from the repository root with the project's interpreter::

    python -m tandem.bench ddp                 # both models, 2 ranks: ~2 min on 2 cores
    python -m tandem.bench ddp --quick         # smoke run: 2 short rounds per model
    python -m tandem.bench ddp --models mlp --rounds 10 --markdown
    python -m tandem.bench.ddp ...             # the same, without the dispatcher
    python -m tandem.bench ddp --hosts 2 --ranks-per-host 2 --link 1gbit:0.2ms   # as root:
        # simulated hosts on shaped links (tandem.bench._hosts, tandem.testing.netns)

Models (batch 32 per rank, SGD, one torch thread per rank):

* ``mlp``  communication-bound: 8 x Linear(1024, 1024) with ReLU, 8.4 M parameters
  (32 MiB of gradients per step);
* ``cnn``  compute-bound: four 3x3 convolutions on 32x32 images, 0.1 M parameters.

How it measures. Time: one set of rank processes joins both tandem (``--backend``,
default "auto": shared memory between ranks of one host;
FileStore rendezvous) and gloo (file://), wraps one copy of the model in each
library's DDP, warms both up, then runs rounds of ``--steps`` steps, alternating
which library goes first, each round after a barrier, so both see the same
machine noise. A round's time per step is its slowest rank's; the table shows the
best round. Memory: ``ru_maxrss`` is a per-process high-water mark, so each library
also trains ``warmup + steps`` steps in processes of its own; "peak" is the growth
of ``ru_maxrss`` from a mark taken after a local forward/backward/step (so grads,
autograd workspace and optimizer imports are already counted) to the end: DDP's
buckets, communication buffers and allocator slack. The largest rank counts.

Across simulated hosts every host shares the machine's cores. Under ``chrt -f`` (equal
real-time priority, no time slices) a host that finishes a step first runs its next
forward and backward on every core, and the other host's threads, with the last of
the step's gradients already in their sockets, run only once it blocks: with tandem,
where one host's leader finishes the 29.4 MB bucket before the other (each host ends
one link time after the *other* host's leader started sending), that host's end
slipped by as long as the first host computed (an all-reduce followed by 80 ms of
compute on the first host: the second ended 80-95 ms after it, 20-30 ms without the
compute; without ``chrt`` no such slip). Real hosts have cores of their own.

ratio = torch step time / tandem step time: above 1 means tandem is faster.
mem ratio = torch peak / tandem peak: above 1 means tandem uses less memory.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import socket
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

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


def _init(lib: str, url: str, rank: int, world: int) -> tuple[Any, Any]:
    """Join ``lib``'s process group; return (its distributed module, its DDP class)."""
    if lib == "tandem":
        import tandem
        from tandem.parallel.ddp import DistributedDataParallel

        tandem.init_process_group(os.environ.get("TANDEM_BENCH_BACKEND", "auto"),
                                  init_method=url, rank=rank, world_size=world,
                                  timeout=_TIMEOUT_S)
        return tandem, DistributedDataParallel
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    tdist.init_process_group("gloo", init_method=url, rank=rank, world_size=world,
                             timeout=datetime.timedelta(seconds=_TIMEOUT_S))
    return tdist, TorchDDP


class _Trainer:
    """One DDP replica of ``model_name`` and its optimizer; ``step()`` is one SGD step."""

    def __init__(self, ddp_class: Any, model_name: str) -> None:
        model, self.x, self.y = build(model_name)
        self.ddp = ddp_class(model)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=1e-4)
        self.params = sum(p.numel() for p in model.parameters())

    def step(self) -> None:
        self.opt.zero_grad()
        F.mse_loss(self.ddp(self.x), self.y).backward()
        self.opt.step()


def _time_main(rank: int, world: int, urls: dict[str, str], model_name: str, warmup: int,
               steps: int, rounds: int) -> dict[str, Any]:
    """Both libraries in one process, rounds alternating, so both see the same noise."""
    torch.set_num_threads(1)
    libs, trainers = {}, {}
    for lib in LIBS:
        libs[lib], ddp_class = _init(lib, urls[lib], rank, world)
        trainers[lib] = _Trainer(ddp_class, model_name)
    try:
        for lib in LIBS:
            for _ in range(warmup):
                trainers[lib].step()
        times: dict[str, list[float]] = {lib: [] for lib in LIBS}
        for r in range(rounds):
            for lib in (LIBS if r % 2 == 0 else LIBS[::-1]):
                libs[lib].barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    trainers[lib].step()
                times[lib].append((time.perf_counter() - start) / steps)
        mean = trainers["tandem"].ddp.stats.mean
        return {"times": times, "params": trainers["tandem"].params, "comm": mean.comm_s,
                "overlap": mean.overlap_s, "buckets": mean.buckets}
    finally:
        for lib in LIBS:
            libs[lib].destroy_process_group()


def _memory_main(rank: int, world: int, lib: str, url: str, model_name: str,
                 steps: int) -> int:
    """Growth of ru_maxrss from a trained-locally model to ``steps`` DDP steps later."""
    torch.set_num_threads(1)
    dist, ddp_class = _init(lib, url, rank, world)
    try:
        model, x, y = build(model_name)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        F.mse_loss(model(x), y).backward()  # grads, autograd workspace, optimizer imports
        opt.step()
        opt.zero_grad()
        del model, opt
        base = _maxrss_bytes()
        trainer = _Trainer(ddp_class, model_name)
        for _ in range(steps):
            trainer.step()
        return _maxrss_bytes() - base
    finally:
        dist.destroy_process_group()


# ---- in the parent --------------------------------------------------------------------


def _spawn_here(world: int, fn: Any, args: tuple[Any, ...], timeout: float) -> list[Any]:
    from tandem.testing import spawn

    env = {"TANDEM_BENCH_BACKEND": os.environ.get("TANDEM_BENCH_BACKEND", "auto")}
    if any(name == "lo" for _, name in socket.if_nameindex()):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo would otherwise pick the hostname's interface
    return spawn(world, fn, args, init=False, timeout=timeout, env=env)


Runner = Callable[[int, Any, tuple[Any, ...], float], list[Any]]


def run(models: Sequence[str], world: int = 2, *, warmup: int = 3, steps: int = 10,
        rounds: int = 6, timeout: float = 600.0,
        runner: Runner | None = None) -> list[dict[str, Any]]:
    """One row per model: best step time and peak memory growth of each library.

    ``runner(world, fn, args, timeout)`` runs ``fn(rank, world, *args)`` on every rank
    and returns the results (default: local processes; across simulated hosts, see
    :func:`main`).
    """
    spawn_ranks = runner or _spawn_here
    rows = []
    for model in models:
        with tempfile.TemporaryDirectory(prefix="tandem-bench-ddp-") as tmp:
            urls = {lib: f"file://{tmp}/{lib}-time" for lib in LIBS}
            per_rank = spawn_ranks(world, _time_main, (urls, model, warmup, steps, rounds), timeout)
            row: dict[str, Any] = {"model": model, "world": world}
            for lib in LIBS:
                # a round lasts as long as its slowest rank; keep the best round
                best = min(max(r["times"][lib][i] for r in per_rank) for i in range(rounds))
                peaks = spawn_ranks(world, _memory_main, (lib, f"file://{tmp}/{lib}-memory", model,
                                                     warmup + steps), timeout)
                row[lib] = {"step": best, "peak": max(peaks), "params": per_rank[0]["params"]}
            row["tandem"].update(comm=per_rank[0]["comm"], overlap=per_rank[0]["overlap"])
        rows.append(row)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench ddp",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma list of {', '.join(MODELS)} (default: both)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--steps", type=int, default=10, help="steps per round (default 10)")
    parser.add_argument("--rounds", type=int, default=6,
                        help="rounds per library, alternating (default 6)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (default 3)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="deadline per library and model, seconds (default 600)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--backend", default="auto",
                        help="tandem backend: auto (default: shared memory on one host), tcp, shm")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 rounds of 3 steps after 1 warm-up step")
    hosts = parser.add_argument_group("across simulated hosts (root; network namespaces)")
    hosts.add_argument("--link", default=None, metavar="RATE[:DELAY[:LOSS]]",
                       help="shape every host's link, e.g. 1gbit:0.2ms (tandem.testing.links)")
    hosts.add_argument("--hosts", type=int, default=None, help="simulated hosts (>= 2)")
    hosts.add_argument("--ranks-per-host", type=int, default=None,
                       help="ranks on each host (default 1); replaces --world-size")
    args = parser.parse_args(argv)
    from tandem.bench.collectives import machine, pick

    models = pick(parser, "--models", args.models, MODELS)
    if args.world_size < 2 or min(args.steps, args.rounds) < 1 or args.warmup < 0:
        parser.error("need --world-size >= 2, --steps/--rounds >= 1, --warmup >= 0")
    warmup, steps, rounds = args.warmup, args.steps, args.rounds
    if args.quick:
        warmup, steps, rounds = 1, 3, 2
    print(f"machine: {machine()}", flush=True)
    start = time.monotonic()
    os.environ["TANDEM_BENCH_BACKEND"] = args.backend
    if args.link is not None or args.hosts or args.ranks_per_host:
        return _main_hosts(parser, args, models, warmup, steps, rounds, start)
    rows = run(models, args.world_size, warmup=warmup, steps=steps, rounds=rounds,
               timeout=args.timeout)
    print(f"DDP: tandem '{args.backend}' vs torch 'gloo', {args.world_size} ranks on loopback, batch "
          f"{BATCH}/rank, 1 thread/rank; best of {rounds} rounds x {steps} steps; ratio = "
          f"torch/tandem step time (>1: tandem faster); mem ratio = "
          f"torch/tandem ru_maxrss growth; {time.monotonic() - start:.0f} s")
    print(format_table(rows, markdown=args.markdown))
    return 0


def _main_hosts(parser: argparse.ArgumentParser, args: argparse.Namespace, models: list[str],
                warmup: int, steps: int, rounds: int, start: float) -> int:
    """``main`` across simulated hosts: the same rows, ranks in network namespaces."""
    from tandem.bench._hosts import Layout, Unavailable, simulated_hosts
    from tandem.testing.links import LinkShape

    try:
        link = LinkShape.parse(args.link or "unshaped")
    except ValueError as exc:
        parser.error(str(exc))
    layout = Layout(args.hosts or 2, args.ranks_per_host or 1)
    if layout.hosts < 2 or layout.ranks_per_host < 1:
        parser.error("need --hosts >= 2 and --ranks-per-host >= 1")
    if args.backend == "shm":
        parser.error("backend 'shm' cannot reach other hosts; use auto or tcp")
    try:
        with simulated_hosts(layout, link) as hosts:
            print(f"{layout}: {hosts.link_report()}", flush=True)
            env = {"TANDEM_BENCH_BACKEND": args.backend}
            rows = run(models, layout.world_size, warmup=warmup, steps=steps, rounds=rounds,
                       timeout=args.timeout,
                       runner=lambda world, fn, a, timeout: hosts.run(fn, a, timeout, env))
    except Unavailable as exc:
        print(f"simulated hosts are unavailable here: {exc}")
        return 1
    print(f"DDP: tandem '{args.backend}' vs torch 'gloo', {layout.hosts} simulated hosts x "
          f"{layout.ranks_per_host} ranks, every host link {link}, batch {BATCH}/rank, 1 "
          f"thread/rank; best of {rounds} rounds x {steps} steps; ratio = torch/tandem step "
          f"time (>1: tandem faster); mem ratio = torch/tandem ru_maxrss growth; "
          f"{time.monotonic() - start:.0f} s")
    print(format_table(rows, markdown=args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
