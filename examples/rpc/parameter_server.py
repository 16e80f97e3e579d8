"""A parameter server: one worker holds the model, trainers train it through RPC.

The model predicts the next character of Python source from the 8 before it (the data
is the running Python's standard library, no download). It lives on worker ``ps``;
each trainer runs its forward there (``model.rpc_sync().forward(x)``), computes the
loss locally, runs the distributed backward pass (gradients land in the server's
autograd context) and steps the server's parameters with a ``DistributedOptimizer``.
The trainers work on different parts of the text at the same time; the server only
serves, then checks that the validation loss fell and prints OK.

    python examples/rpc/parameter_server.py            # 1 server + 2 trainers, ~1 min
    python examples/rpc/parameter_server.py --quick    # smoke run
    python -m tandem.run --standalone --nproc-per-node 3 examples/rpc/parameter_server.py
"""

from __future__ import annotations

import argparse
import threading

import torch
from torch import nn
from torch.nn import functional as F

import tandem.autograd as dist_autograd
import tandem.rpc as rpc
from tandem.optim import DistributedOptimizer

from _common import VOCAB, launch, text, windows

CONTEXT = 8
_model: nn.Module | None = None
_lock = threading.Lock()


class CharModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(len(VOCAB), 24)
        self.hidden = nn.Linear(CONTEXT * 24, 192)
        self.out = nn.Linear(192, len(VOCAB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Trainers step these parameters in place whenever they like (asynchronous SGD),
        # possibly between another trainer's forward and its backward; computing on a
        # snapshot keeps what that backward needs intact, and gradients still reach the
        # parameters through the copies.
        p = {name: t.clone() for name, t in self.named_parameters()}
        h = F.embedding(x, p["emb.weight"]).flatten(1)
        h = F.relu(F.linear(h, p["hidden.weight"], p["hidden.bias"]))
        return F.linear(h, p["out.weight"], p["out.bias"])


def get_model() -> rpc.RRef[CharModel]:
    """On the server: the one model every trainer trains (made on first request)."""
    global _model
    with _lock:
        if _model is None:
            _model = CharModel()
        return rpc.RRef(_model)


def parameter_rrefs(model: rpc.RRef[CharModel]) -> list[rpc.RRef[nn.Parameter]]:
    return [rpc.RRef(p) for p in model.local_value().parameters()]


def validation_loss(model: nn.Module, val: torch.Tensor) -> float:
    x, y = windows(val, CONTEXT, 2048)
    with torch.no_grad():
        return nn.functional.cross_entropy(model(x), y).item()


def train(rank: int, args: argparse.Namespace, ids: torch.Tensor) -> None:
    model = rpc.rpc_sync("ps", get_model)
    opt = DistributedOptimizer(torch.optim.SGD, rpc.rpc_sync("ps", parameter_rrefs,
                                                            args=(model,)), lr=0.3)
    share = len(ids) // (args.trainers)
    for step in range(args.steps):
        x, y = windows(ids, CONTEXT, args.batch, offset=(rank - 1) * share + step * args.batch)
        with dist_autograd.context() as ctx:
            loss = nn.functional.cross_entropy(model.rpc_sync().forward(x), y)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        if step % max(1, args.steps // 4) == 0 or step == args.steps - 1:
            print(f"trainer{rank} step {step:4d}  loss {loss.item():.3f}", flush=True)


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world)  # env:// (MASTER_ADDR, MASTER_PORT)
    train_ids, val = text(400_000 if args.quick else 2_000_000)
    before = validation_loss(CharModel(), val) if rank == 0 else 0.0
    if rank > 0:
        train(rank, args, train_ids)
    rpc.shutdown()  # the server waits here until every trainer is done
    if rank == 0:
        assert _model is not None, "no trainer asked for the model"
        after = validation_loss(_model, val)
        print(f"validation loss {before:.3f} -> {after:.3f}", flush=True)
        if after > 0.85 * before:
            raise SystemExit("the validation loss did not fall enough")
        print("OK", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="60 steps")
    args = parser.parse_args()
    if args.quick:
        args.steps = 60
    launch(worker, args.trainers + 1, args)


if __name__ == "__main__":
    main()
