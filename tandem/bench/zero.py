"""ZeroRedundancyOptimizer step time and memory: tandem against torch's (gloo).

Run from the repository root with the project's interpreter::

    python -m tandem.bench zero                    # time at 2 ranks, memory at 2 and 4: ~4 min
    python -m tandem.bench zero --quick            # smoke run: 2 short rounds, memory at 2
    python -m tandem.bench zero --world-sizes 2,4 --memory-world-sizes 2 --markdown
    python -m tandem.bench zero --bucket-view      # both with parameters_as_bucket_view=True

The model is the 8.4 M-parameter MLP of ``tandem.bench ddp`` (8 x Linear(1024, 1024),
batch 32 per rank), trained with Adam (lr 1e-4) under each library's DDP, one torch
thread per rank. Contenders:

* ``torch zero``    torch DDP + torch's ZeroRedundancyOptimizer(Adam), gloo;
* ``zero``          tandem DDP + tandem's ZeroRedundancyOptimizer(Adam) (``--backend``,
  default auto: shared memory between ranks of one host);
* ``zero2``         the same with ``shard_gradients`` (each rank keeps its gradients only);
* ``zero2+overlap`` the same with ``overlap_with_ddp`` and ``hook_with_zero_step``;
* ``ddp``           DDP + plain Adam (memory only, for reference), for both libraries.

Time: one set of rank processes joins both libraries, builds every contender, warms
them up, then runs rounds of ``--steps`` steps (zero_grad, forward, backward, step),
rotating which goes first, each round after a barrier, so all see the same machine
noise. A round's time per step is its slowest rank's; the table shows each
contender's best round and ratio = torch zero / that contender (> 1: tandem faster).
"CPU / step" is the CPU time of all threads of all ranks per step (best round): on a
shared machine it moves much less than wall time, and it is the work each library
does (tandem's waits in shared memory spin briefly, and that counts).

Memory: every contender trains ``warmup + steps`` steps in processes of its own.
"state" is the bytes of the optimizer state tensors on a rank (the plain optimizer's
total divided by N is the ideal), "grads" the bytes of the ``.grad`` tensors a rank
holds after backward, "peak" the growth of ``ru_maxrss`` from the resident size
after start-up (process group joined, an optimizer imported and stepped once) to the
end: parameters, gradients, optimizer state, communication buffers and allocator
slack. Each column shows the largest rank's figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any, Sequence

import torch
from torch.nn import functional as F

from tandem.bench.ddp import BATCH, _init, _maxrss_bytes, _mb, _ms, _spawn_here

__all__ = ["main", "run_time", "run_memory"]

TIMED = ("torch zero", "zero", "zero2", "zero2+overlap")
MEMORY = ("torch ddp", "torch zero", "ddp", "zero", "zero2")
LR = 1e-4


def build(width: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """8 x Linear(width, width) with ReLU (width 1024: ``tandem.bench ddp``'s MLP) and a batch."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers), torch.randn(BATCH, width), torch.randn(BATCH, width)


def _lib(contender: str) -> str:
    return "torch" if contender.startswith("torch") else "tandem"


class _Trainer:
    """One contender's DDP replica of the MLP and its optimizer."""

    def __init__(self, contender: str, ddp_class: Any, bucket_view: bool, width: int) -> None:
        model, self.x, self.y = build(width)
        self.ddp = ddp_class(model)
        self.overlap = contender.endswith("overlap")
        if contender.endswith("ddp"):
            self.opt: Any = torch.optim.Adam(self.ddp.parameters(), lr=LR)
        elif _lib(contender) == "torch":
            from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

            self.opt = TorchZero(self.ddp.parameters(), torch.optim.Adam, lr=LR,
                                 parameters_as_bucket_view=bucket_view)
        else:
            from tandem.optim import ZeroRedundancyOptimizer, hook_with_zero_step, shard_gradients
            from tandem.parallel.comm_hooks import allreduce_hook

            self.opt = ZeroRedundancyOptimizer(self.ddp.parameters(), torch.optim.Adam, lr=LR,
                                               parameters_as_bucket_view=bucket_view,
                                               overlap_with_ddp=self.overlap)
            if contender.startswith("zero2"):
                shard_gradients(self.ddp, self.opt)
            if self.overlap:
                self.ddp.register_comm_hook(None, hook_with_zero_step(
                    allreduce_hook, self.ddp, self.opt, shard_buckets=True))

    def step(self) -> None:
        self.opt.zero_grad()
        F.mse_loss(self.ddp(self.x), self.y).backward()
        if not self.overlap:
            self.opt.step()

    def held(self) -> tuple[int, int]:
        """(optimizer state bytes, gradient bytes) on this rank right after a backward."""
        self.opt.zero_grad()
        F.mse_loss(self.ddp(self.x), self.y).backward()
        grads = sum(p.grad.numel() * p.grad.element_size()
                    for p in self.ddp.parameters() if p.grad is not None)
        opt = getattr(self.opt, "optim", self.opt)  # a ZeRO's local optimizer
        state = sum(t.numel() * t.element_size() for s in opt.state.values()
                    for t in s.values() if torch.is_tensor(t))
        return state, grads


def _quiet() -> None:
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)  # torch's jit, on import


def _time_main(rank: int, world: int, urls: dict[str, str], warmup: int, steps: int,
               rounds: int, bucket_view: bool,
               width: int) -> dict[str, list[tuple[float, float]]]:
    torch.set_num_threads(1)
    _quiet()
    libs, trainers = {}, {}
    for lib in ("tandem", "torch"):
        libs[lib], ddp_class = _init(lib, urls[lib], rank, world)
        for c in (c for c in TIMED if _lib(c) == lib):
            trainers[c] = _Trainer(c, ddp_class, bucket_view, width)
    try:
        for t in trainers.values():
            for _ in range(warmup):
                t.step()
        times: dict[str, list[tuple[float, float]]] = {c: [] for c in TIMED}
        for r in range(rounds):
            order = TIMED[r % len(TIMED):] + TIMED[:r % len(TIMED)]
            for c in order:
                libs[_lib(c)].barrier()
                start, cpu = time.perf_counter(), time.process_time()  # all threads
                for _ in range(steps):
                    trainers[c].step()
                times[c].append(((time.perf_counter() - start) / steps,
                                 (time.process_time() - cpu) / steps))
        return times
    finally:
        for lib in libs.values():
            lib.destroy_process_group()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory_main(rank: int, world: int, contender: str, url: str, steps: int,
                 bucket_view: bool, width: int) -> dict[str, int]:
    torch.set_num_threads(1)
    _quiet()
    dist, ddp_class = _init(_lib(contender), url, rank, world)
    try:
        warm = torch.nn.Linear(4, 4)  # imports and first-use costs, outside the measure
        opt = torch.optim.Adam(warm.parameters())
        warm(torch.randn(2, 4)).sum().backward()
        opt.step()
        base = _rss_bytes()
        trainer = _Trainer(contender, ddp_class, bucket_view, width)
        for _ in range(steps):
            trainer.step()
        state, grads = trainer.held()
        return {"state": state, "grads": grads, "peak": _maxrss_bytes() - base}
    finally:
        dist.destroy_process_group()


def run_time(world: int, *, warmup: int = 3, steps: int = 10, rounds: int = 6,
             bucket_view: bool = False, width: int = 1024,
             timeout: float = 900.0) -> dict[str, tuple[float, float]]:
    """Per timed contender at ``world`` ranks: (best round's step time, best round's CPU
    seconds per step summed over the ranks)."""
    with tempfile.TemporaryDirectory(prefix="tandem-bench-zero-") as tmp:
        urls = {lib: f"file://{tmp}/{lib}" for lib in ("tandem", "torch")}
        per_rank = _spawn_here(world, _time_main, (urls, warmup, steps, rounds, bucket_view, width),
                          timeout)
    return {c: (min(max(r[c][i][0] for r in per_rank) for i in range(rounds)),
                min(sum(r[c][i][1] for r in per_rank) for i in range(rounds))) for c in TIMED}


def run_memory(world: int, *, steps: int = 13, bucket_view: bool = False, width: int = 1024,
               timeout: float = 900.0) -> dict[str, dict[str, int]]:
    """Per contender, the largest rank's state, gradient and peak bytes at ``world`` ranks."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-zero-") as tmp:
        for c in MEMORY:
            url = f"file://{tmp}/{c.replace(' ', '-')}"
            per_rank = _spawn_here(world, _memory_main, (c, url, steps, bucket_view, width), timeout)
            out[c] = {k: max(r[k] for r in per_rank) for k in ("state", "grads", "peak")}
    return out


def _table(header: Sequence[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(cells, widths)))
                     for cells in [list(header), *rows])


def format_time(results: dict[int, dict[str, tuple[float, float]]],
                markdown: bool = False) -> str:
    header = ["ranks", "contender", "step", "ratio", "CPU / step", "CPU ratio"]
    rows = []
    for world, t in sorted(results.items()):
        wall, cpu = t["torch zero"]
        for c in TIMED:
            rows.append([str(world), c, _ms(t[c][0]), f"{wall / t[c][0]:.2f}", _ms(t[c][1]),
                         f"{cpu / t[c][1]:.2f}"])
    return _table(header, rows, markdown)


def format_memory(results: dict[int, dict[str, dict[str, int]]], markdown: bool = False) -> str:
    header = ["ranks", "contender", "state / rank", "of plain", "grads / rank", "of plain",
              "peak growth / rank"]
    rows = []
    for world, by in sorted(results.items()):
        for c in MEMORY:
            m = by[c]
            plain = by["torch ddp" if _lib(c) == "torch" else "ddp"]
            rows.append([str(world), c, _mb(m["state"]), f"{m['state'] / plain['state']:.3f}",
                         _mb(m["grads"]), f"{m['grads'] / plain['grads']:.3f}", _mb(m["peak"])])
    return _table(header, rows, markdown)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench zero",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--world-sizes", default="2", help="ranks for the timing (default 2)")
    parser.add_argument("--memory-world-sizes", default="2,4",
                        help="ranks for the memory figures (default 2,4; empty: none)")
    parser.add_argument("--steps", type=int, default=10, help="steps per round (default 10)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per contender (default 6)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (default 3)")
    parser.add_argument("--bucket-view", action="store_true",
                        help="parameters_as_bucket_view=True for both libraries")
    parser.add_argument("--backend", default="auto", help="tandem backend (default auto)")
    parser.add_argument("--width", type=int, default=1024,
                        help="MLP width (default 1024: 8.4 M parameters; --quick: 128)")
    parser.add_argument("--timeout", type=float, default=900.0, help="deadline per run, s")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: width 128, 2 rounds of 2 steps after 1 warm-up, "
                             "memory at 2 ranks")
    args = parser.parse_args(argv)
    try:
        timed, measured = _ints(args.world_sizes), _ints(args.memory_world_sizes)
    except ValueError:
        parser.error("--world-sizes and --memory-world-sizes take comma-separated integers")
    if min(timed + measured + [2]) < 2 or min(args.steps, args.rounds) < 1 or args.warmup < 0:
        parser.error("need world sizes >= 2, --steps/--rounds >= 1, --warmup >= 0")
    warmup, steps, rounds = args.warmup, args.steps, args.rounds
    width = args.width
    if args.quick:
        warmup, steps, rounds, measured, width = 1, 2, 2, [2], 128
    os.environ["TANDEM_BENCH_BACKEND"] = args.backend
    start = time.monotonic()
    times = {w: run_time(w, warmup=warmup, steps=steps, rounds=rounds, width=width,
                         bucket_view=args.bucket_view, timeout=args.timeout) for w in timed}
    memory = {w: run_memory(w, steps=warmup + steps, bucket_view=args.bucket_view, width=width,
                            timeout=args.timeout) for w in measured}
    from tandem.bench.collectives import machine

    print(f"machine: {machine()}")
    params = sum(p.numel() for p in build(width)[0].parameters())
    print(f"ZeroRedundancyOptimizer(Adam) on an 8-layer MLP of {params / 1e6:.2f} M parameters, "
          f"batch {BATCH}/rank, 1 "
          f"thread/rank, tandem '{args.backend}' vs torch 'gloo', bucket view "
          f"{'on' if args.bucket_view else 'off'}; best of {rounds} rounds x {steps} steps; "
          f"ratio = torch zero step / tandem step (>1: tandem faster); "
          f"{time.monotonic() - start:.0f} s")
    if times:
        print(format_time(times, args.markdown))
    if memory:
        print()
        print(format_memory(memory, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
