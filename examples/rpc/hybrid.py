"""Hybrid parallelism: an embedding table on a server (RPC) and a dense part under DDP.

Worker ``server`` owns one ``nn.Embedding`` as a ``RemoteModule``; two trainers share
it and each holds a replica of the dense layers wrapped in tandem's
``DistributedDataParallel``, over a process group of the two trainers on a port of its
own (RPC uses MASTER_PORT). One training step on a trainer: look the characters up on
the server, run the dense part locally, then one distributed backward pass: DDP
averages the dense gradients between the trainers inside it, and the embedding's
gradients go to the server. A ``DistributedOptimizer`` steps both (the embedding on the
server, the dense replica here). The data is Python's own source, one character at a
time. It checks that the loss fell and that the two dense replicas stayed identical,
then prints OK.

    python examples/rpc/hybrid.py                 # server + 2 trainers
    python examples/rpc/hybrid.py --quick
    EXAMPLE_PG_PORT=29601 python -m tandem.run --standalone --nproc-per-node 3 examples/rpc/hybrid.py
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import tandem
import tandem.autograd as dist_autograd
import tandem.rpc as rpc
from tandem.nn import RemoteModule
from tandem.optim import DistributedOptimizer
from tandem.parallel import DistributedDataParallel

from _common import VOCAB, launch, text, windows

CONTEXT, DIM = 8, 16
_table: list[RemoteModule] = []


def seeded_embedding() -> nn.Module:
    torch.manual_seed(3)
    return nn.Embedding(len(VOCAB), DIM)


def embedding_table() -> RemoteModule:
    """On the server: the one table both trainers use (a RemoteModule travels by RPC)."""
    if not _table:
        _table.append(RemoteModule("server/cpu", seeded_embedding))
    return _table[0]


def dense() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Flatten(), nn.Linear(CONTEXT * DIM, 128), nn.ReLU(),
                         nn.Linear(128, len(VOCAB)))


def train(trainer: int, args: argparse.Namespace) -> None:
    port = os.environ.get("EXAMPLE_PG_PORT") or str(int(os.environ["MASTER_PORT"]) + 1)
    tandem.init_process_group(init_method=f"tcp://{os.environ['MASTER_ADDR']}:{port}",
                              rank=trainer, world_size=2)
    table = rpc.rpc_sync("server", embedding_table)
    model = DistributedDataParallel(dense())
    params = table.remote_parameters() + [rpc.RRef(p) for p in model.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.2)
    ids, _ = text(300_000)
    losses = []
    for step in range(args.steps):
        x, y = windows(ids, CONTEXT, args.batch, offset=(2 * step + trainer) * args.batch)
        with dist_autograd.context() as ctx:
            loss = nn.functional.cross_entropy(model(table(x)), y)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        losses.append(loss.item())
        if step % max(1, args.steps // 4) == 0 or step == args.steps - 1:
            print(f"trainer{trainer} step {step:4d}  loss {losses[-1]:.3f}", flush=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(2)]
    tandem.all_gather(replicas, flat)
    tandem.destroy_process_group()
    if not torch.equal(replicas[0], replicas[1]):
        raise SystemExit("the DDP replicas of the dense part diverged")
    if sum(losses[-5:]) > 0.8 * sum(losses[:5]):
        raise SystemExit(f"trainer{trainer}: the loss did not fall: {losses[:5]} ... {losses[-5:]}")


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    rpc.init_rpc("server" if rank == 0 else f"trainer{rank - 1}", rank=rank, world_size=world)
    if rank > 0:
        train(rank - 1, args)
    rpc.shutdown()  # the server returns once both trainers are done
    if rank == 0:
        print("OK", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="40 steps")
    args = parser.parse_args()
    if args.quick:
        args.steps = 40
    launch(worker, 3, args)


if __name__ == "__main__":
    main()
