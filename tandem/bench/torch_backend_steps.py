"""The training-step parts of ``python -m tandem.bench torch-backend``: torch's own DDP
and FSDP2 on each group, same model, data and seeds.

* ``ddp``: a step (forward, backward, SGD) of torch's DistributedDataParallel on the
  8.4 M-parameter MLP of ``python -m tandem.bench ddp``, batch 32 per rank.
* ``fsdp``: a step of torch's FSDP2 (``fully_shard`` per layer and at the root, Adam)
  on a small transformer (4 layers, width 256, 2.6 M parameters), batch 8 x 64 tokens.
  Its rounds also time the step's collectives (:class:`CollectiveClock`), so the
  table's reader sees the share of the step that a library can speed up at all.
* ``fsdp-short`` (only when asked for): the same FSDP2 step on one sequence of 64
  tokens per rank instead of 8. The collectives are those of ``fsdp`` (they move
  parameters and gradients, whatever the batch) while the computation shrinks about
  eightfold: a step in which the library's share is large.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from tandem.bench.torch_backend_rounds import CollectiveClock, Contender, best_rounds

__all__ = ["TinyTransformer", "steps_part", "FSDP_COLLECTIVES"]

# what FSDP2 calls on its groups (all_reduce only for a replicated mesh dimension)
FSDP_COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce",
                    "all_gather_into_tensor", "reduce_scatter_tensor")


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


def _trainer(model: nn.Module, wrap: Callable[[nn.Module], nn.Module], data: Any,
             loss: Callable[[nn.Module, Any], torch.Tensor],
             optimizer: Callable[[Any], torch.optim.Optimizer]) -> Callable[[], object]:
    wrapped = wrap(model)
    opt = optimizer(wrapped.parameters())

    def step() -> None:
        opt.zero_grad()
        loss(wrapped, data).backward()
        opt.step()

    return step


def _mse(m: nn.Module, d: Any) -> torch.Tensor:
    return F.mse_loss(m(d[0]), d[1])


def _next_token(m: nn.Module, d: Any) -> torch.Tensor:
    logits = m(d[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), d[:, 1:].reshape(-1))


def _ddp(gloo: Any, small: bool) -> tuple[nn.Module, dict[str, Callable[[nn.Module], nn.Module]],
                                          Any, str]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tandem.bench.ddp import build

    model, x, y = build("cnn" if small else "mlp")
    wraps: dict[str, Callable[[nn.Module], nn.Module]] = {
        "tandem": lambda m: DDP(m), "gloo": lambda m: DDP(m, process_group=gloo)}
    params = sum(p.numel() for p in model.parameters())
    return model, wraps, (x, y), f"{'cnn' if small else 'mlp'}, {params / 1e6:.1f} M params"


def _fsdp(gloo: Any, rank: int, world: int, small: bool, batch: int
          ) -> tuple[nn.Module, dict[str, Callable[[nn.Module], nn.Module]], Any, str]:
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

    data = torch.randint(0, model.vocab, (batch, 65),
                         generator=torch.Generator().manual_seed(rank))
    params = sum(p.numel() for p in model.parameters())
    return (model, {n: shard(mesh) for n, mesh in meshes.items()}, data,
            f"transformer, {params / 1e6:.1f} M params, {batch} x 64 tokens")


def steps_part(part: str, gloo: Any, rank: int, world: int, warmup: int, steps: int,
               rounds: int, small: bool) -> list[dict[str, Any]]:
    """One row: each contender's per-round seconds per training step of ``part``."""
    import torch.distributed as dist

    optimizer: Callable[[Any], torch.optim.Optimizer]
    clock: CollectiveClock | None
    if part == "ddp":
        model, wraps, data, what = _ddp(gloo, small)
        loss, optimizer = _mse, lambda ps: torch.optim.SGD(ps, lr=1e-4)
        # DDP's reducer calls the group from C++: no Python function to time
        clock = None
    else:
        model, wraps, data, what = _fsdp(gloo, rank, world, small, 1 if part == "fsdp-short" else 8)
        loss, optimizer = _next_token, lambda ps: torch.optim.Adam(ps, lr=1e-4)
        clock = CollectiveClock(FSDP_COLLECTIVES)
    steppers = {n: _trainer(copy.deepcopy(model), wrap, data, loss, optimizer)
                for n, wrap in wraps.items()}
    for step in steppers.values():
        for _ in range(warmup):
            step()
    barriers = {"tandem": dist.barrier, "gloo": lambda: dist.barrier(group=gloo)}
    contenders: dict[str, Contender] = {n: (barriers[n], s) for n, s in steppers.items()}
    iters = {n: steps for n in contenders}
    if clock is None:
        times = best_rounds(contenders, iters, rounds)
    else:
        with clock:
            times = best_rounds(contenders, iters, rounds, clock)
    return [{"part": part, "what": what, "times": times}]
