"""What compressing DiLoCo's outer exchange costs in loss: none, bf16 and int8, plain and streaming.

4 ranks (processes, FileStore) train the same MLP on a teacher network's labels, each
rank on its own samples: AdamW inside, SGD with Nesterov momentum outside, the same
seeds and data for every setting. Prints per setting the validation loss of the outer
model at the end, the bytes rank 0 sent for outer exchanges, their time and the share
of it hidden behind compute (on one machine's loopback the exchanges are short)::

    python examples/diloco_compression.py            # about a minute on 2 idle cores
    python examples/diloco_compression.py --steps 600 --sync-every 20
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tandem.algorithms.diloco import DiLoCo
from tandem.testing import spawn

SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("none", {}),
    ("bf16", {"compression": "bf16"}),
    ("int8", {"compression": "int8"}),
    ("streaming, none", {"fragments": 4}),
    ("streaming, int8", {"fragments": 4, "compression": "int8"}),
]
DIM, CLASSES, BATCH = 32, 10, 32


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, CLASSES))


def _data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and the labels a fixed random teacher gives them (learnable, not trivially)."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(DIM, CLASSES, generator=gen.manual_seed(12345))
    x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed))
    return x, (torch.tanh(x) @ teacher + 0.3 * x[:, :CLASSES] ** 2).argmax(dim=1)


def _rank(rank: int, world: int, steps: int, sync_every: int) -> dict[str, Any]:
    x, y = _data(100 + rank, steps * BATCH)
    vx, vy = _data(7, 4096)
    out = {}
    for name, kwargs in SETTINGS:
        net = _net()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.0)
        diloco = DiLoCo(net, opt, outer_optimizer=lambda ps: torch.optim.SGD(
            ps, lr=0.7, momentum=0.9, nesterov=True), sync_every=sync_every, **kwargs)
        for step in range(steps):
            lo = step * BATCH
            F.cross_entropy(net(x[lo:lo + BATCH]), y[lo:lo + BATCH]).backward()
            opt.step()
            opt.zero_grad()
            diloco.step()
        diloco.sync()
        with torch.no_grad():
            for p, outer in zip(net.parameters(), diloco.outer_params):
                p.copy_(outer)
            out[name] = (F.cross_entropy(net(vx), vy).item(), diloco.bytes_sent,
                         diloco.comm_seconds, diloco.hidden_fraction)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="inner steps per rank")
    parser.add_argument("--sync-every", type=int, default=20, help="H, inner steps per sync")
    args = parser.parse_args()
    results = spawn(4, _rank, (args.steps, args.sync_every), timeout=1800)
    base = results[0]["none"][0]
    print(f"4 ranks, {args.steps} inner steps, H={args.sync_every}")
    print(f"{'setting':<18} {'val loss':>9} {'vs none':>8} {'bytes sent':>12} "
          f"{'comm s':>7} {'hidden':>7}")
    for name, _ in SETTINGS:
        loss, sent, comm, hidden = results[0][name]
        print(f"{name:<18} {loss:>9.4f} {100 * (loss / base - 1):>+7.2f}% {sent:>12,} "
              f"{comm:>7.3f} {100 * hidden:>6.1f}%")


if __name__ == "__main__":
    main()
