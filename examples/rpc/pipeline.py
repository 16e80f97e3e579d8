"""Pipeline parallelism: a model split across 2 workers, micro-batches in flight.

The first stage (an embedding and a hidden layer) lives on ``stage0``, the second (two
more layers) on ``stage1``; the driver holds no parameters. A batch is cut into
micro-batches; for each, the driver asks ``stage0`` for its activations, kept there in
an RRef (``remote``), and hands that RRef to ``stage1``, which fetches them straight
from ``stage0``: activations never pass through the driver, and while ``stage1``
works on one micro-batch ``stage0`` already computes the next. Distributed autograd
carries the gradients back along the same path; a ``DistributedOptimizer`` steps both
stages. The model reads Python source one character at a time (the stdlib's).

The example checks itself: training the pipeline must give the same parameters as
training the same model in one process on the same batches (within 1e-5). It prints OK.

    python examples/rpc/pipeline.py                     # driver + 2 stages
    python examples/rpc/pipeline.py --quick
    python -m tandem.run --standalone --nproc-per-node 3 examples/rpc/pipeline.py
"""

from __future__ import annotations

import argparse
import threading
from typing import Any

import torch
from torch import nn

import tandem.autograd as dist_autograd
import tandem.rpc as rpc
from tandem.optim import DistributedOptimizer

from _common import VOCAB, launch, text, windows

CONTEXT = 8


def first_stage() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Embedding(len(VOCAB), 16), nn.Flatten(), nn.Linear(CONTEXT * 16, 128),
                         nn.ReLU())


def second_stage() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, len(VOCAB)))


class Stage:
    """One stage on its worker; micro-batches may arrive on several server threads."""

    def __init__(self, make: Any) -> None:
        self.module = make()
        self.lock = threading.Lock()

    def forward(self, x: Any) -> torch.Tensor:
        if isinstance(x, rpc.RRef):
            x = x.to_here()  # the previous stage's activations, straight from its worker
        with self.lock:
            return self.module(x)

    def parameters(self) -> list[rpc.RRef[nn.Parameter]]:
        return [rpc.RRef(p) for p in self.module.parameters()]


class Pipeline:
    """On the driver: the two stages, and a forward that keeps micro-batches in flight."""

    def __init__(self, micro_batches: int) -> None:
        self.stages = [rpc.remote("stage0", Stage, args=(first_stage,)),
                       rpc.remote("stage1", Stage, args=(second_stage,))]
        self.micro_batches = micro_batches

    def parameter_rrefs(self) -> list[rpc.RRef[nn.Parameter]]:
        return [p for s in self.stages for p in s.rpc_sync().parameters()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = []
        for part in x.chunk(self.micro_batches):
            hidden = self.stages[0].remote().forward(part)  # stays on stage0
            outputs.append(self.stages[1].rpc_async().forward(hidden))
        return torch.cat(torch.futures.wait_all(outputs))


def train_locally(batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> list[torch.Tensor]:
    model = nn.Sequential(first_stage(), second_stage())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    rpc.init_rpc("driver" if rank == 0 else f"stage{rank - 1}", rank=rank, world_size=world)
    if rank == 0:
        ids, _ = text(300_000)
        batches = [windows(ids, CONTEXT, args.batch, offset=i * args.batch)
                   for i in range(args.steps)]
        pipe = Pipeline(args.micro_batches)
        params = pipe.parameter_rrefs()
        opt = DistributedOptimizer(torch.optim.SGD, params, lr=args.lr)
        for step, (x, y) in enumerate(batches):
            with dist_autograd.context() as ctx:
                loss = nn.functional.cross_entropy(pipe.forward(x), y)
                dist_autograd.backward(ctx, [loss])
                opt.step(ctx)
            if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
                print(f"step {step:4d}  loss {loss.item():.3f}", flush=True)
        oracle = train_locally(batches, args.lr)
        worst = max((p.to_here() - q).abs().max().item() for p, q in zip(params, oracle))
        print(f"largest difference from training in one process: {worst:.2e}", flush=True)
        if worst > 1e-5:
            raise SystemExit("the pipeline trained differently from one process")
        print("OK", flush=True)
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--quick", action="store_true", help="20 steps")
    args = parser.parse_args()
    if args.quick:
        args.steps = 20
    launch(worker, 3, args)


if __name__ == "__main__":
    main()
