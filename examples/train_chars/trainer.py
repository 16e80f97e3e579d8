"""One rank's training job; tandem must already be initialised (see ``train_chars.py``).

Training is deterministic, so that a run resumed from a checkpoint ends with exactly the
parameters of an uninterrupted run: the model is initialised from ``--seed``, the data
order comes from ``DistributedSampler(seed)`` and the epoch (a resumed epoch skips the
batches already done), the learning rate is a function of the step, the optimizer state
is checkpointed, and the global RNG is re-seeded from (seed, rank, step) before every
step, so no RNG state needs saving. On CPU with one thread per rank torch's kernels are
deterministic.

``zero`` shards the AdamW state over the ranks (``tandem.optim.ZeroRedundancyOptimizer``;
the checkpoint still holds the plain AdamW state dict, so a run may resume with or
without it), ``shard_grads`` also keeps only each rank's shard of the gradients, and
``uneven`` gives rank r ``uneven * r`` steps fewer than rank 0, inside ``Join``: the
ranks that finish first shadow the others' collectives until rank 0 is done. In that
mode the per-step loss is the rank's own (a per-step all-reduce of it is a collective
that no joined rank would shadow) and checkpoints are written at the end only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

import tandem as dist
from tandem.algorithms.join import Join
from tandem.optim import ZeroRedundancyOptimizer, shard_gradients
from tandem.parallel import DistributedDataParallel, DistributedSampler

from train_chars import checkpoint
from train_chars.elastic import joining, train_elastic
from train_chars.data import VOCAB, CharWindows, decode, encode, load_corpus
from train_chars.model import CharTransformer, ModelConfig
from train_chars.plot import write_loss_png
from train_chars.preempt import Preemption
from train_chars.progress import Progress
from train_chars.sync import make_sync

__all__ = ["RunConfig", "train"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    steps: int
    batch_size: int  # per rank
    seq_len: int
    dim: int
    layers: int
    heads: int
    lr: float
    corpus_mb: float
    eval_windows: int
    out: str | None  # None: a new numbered run directory (see checkpoint.py)
    resume: bool
    seed: int
    save_every: int
    sample_chars: int
    zero: bool = False
    shard_grads: bool = False
    uneven: int = 0
    elastic: bool = False
    sync: str = "ddp"  # or "local-sgd", "diloco" (train_chars/sync.py)
    inner_steps: int = 1  # local-sgd, diloco: steps between syncs
    fragments: int = 1  # diloco: parts of the model that sync in turn
    outer_lr: float = 0.7  # diloco: the outer SGD's learning rate
    outer_momentum: float = 0.9  # diloco: its Nesterov momentum (0: none)
    eval_every: int = 0  # 0: evaluate at the start and the end only


def _lr(cfg: RunConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak at ``cfg.steps``."""
    warmup = max(1, min(20, cfg.steps // 10))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, cfg.steps - warmup))
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def _mean_over_ranks(value: torch.Tensor) -> float:
    buf = value.detach().double().reshape(1).clone()
    dist.all_reduce(buf)
    return float(buf.item()) / dist.get_world_size()


@torch.no_grad()
def evaluate(model: CharTransformer, ids: torch.Tensor, cfg: RunConfig) -> float:
    """Mean validation loss (nats/char) over the first ``eval_windows`` windows, split by rank."""
    windows = CharWindows(ids, cfg.seq_len)
    subset = Subset(windows, range(min(len(windows), cfg.eval_windows)))
    sampler = DistributedSampler(subset, shuffle=False, drop_last=True)
    totals = torch.zeros(2, dtype=torch.float64)
    model.eval()
    for x, y in DataLoader(subset, batch_size=cfg.batch_size, sampler=sampler):
        logits = model(x)
        totals[0] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").double()
        totals[1] += y.numel()
    model.train()
    dist.all_reduce(totals)
    return float(totals[0] / totals[1])


def _verify(path: str, model: CharTransformer, step: int) -> int:
    """Reload the checkpoint into a fresh model; return how many tensors matched exactly."""
    state = checkpoint.load(path)
    fresh = CharTransformer(ModelConfig(**state["model_config"]))
    fresh.load_state_dict(state["model"])
    live = model.state_dict()
    for name, tensor in fresh.state_dict().items():
        if not torch.equal(tensor, live[name]):
            raise RuntimeError(f"checkpoint {path}: {name} differs from the trained model")
    if state["step"] != step or not state["optimizer"]["state"]:
        raise RuntimeError(f"checkpoint {path}: step {state['step']} (expected {step}) or "
                           f"empty optimizer state")
    return len(live)


def _step_seed(seed: int, rank: int, step: int) -> int:
    return (seed * 1_000_003 + step) * 1_009 + rank


def _optimizer(cfg: RunConfig, model: CharTransformer) -> torch.optim.Optimizer:
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": (0.9, 0.95), "weight_decay": 0.01}
    if cfg.zero or cfg.shard_grads:
        return ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **kwargs)
    return torch.optim.AdamW(model.parameters(), **kwargs)


def _optimizer_state(optimizer: torch.optim.Optimizer, lead: bool) -> dict[str, Any]:
    """The plain AdamW state dict on rank 0 (every rank calls this)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if lead else {}
    return optimizer.state_dict()


def _describe(cfg: RunConfig) -> str:
    if cfg.sync == "local-sgd":
        return f"AdamW, local SGD: parameters averaged every {cfg.inner_steps} steps"
    if cfg.sync == "diloco":
        streaming = f", streamed in {cfg.fragments} fragments" if cfg.fragments > 1 else ""
        return f"DiLoCo: AdamW inside, an outer step every {cfg.inner_steps} steps{streaming}"
    opt = "AdamW"
    if cfg.zero or cfg.shard_grads:
        opt = f"ZeroRedundancyOptimizer(AdamW){', sharded gradients' if cfg.shard_grads else ''}"
    return opt + (f", Join with rank r training {cfg.uneven} x r steps fewer" if cfg.uneven else "")


def train(cfg: RunConfig) -> dict[str, Any]:
    """Train, evaluate, checkpoint; rank 0 also plots, samples and writes metrics.json."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lead = rank == 0
    preemption = Preemption()  # before the slow set-up: a warning then is kept, not fatal
    torch.manual_seed(cfg.seed)
    train_ids, val_ids, n_files = load_corpus(int(cfg.corpus_mb * 1e6))
    shortest = min(len(train_ids), len(val_ids)) - 1  # characters that have a next one
    if shortest < cfg.seq_len * world:
        raise ValueError(f"--seq-len {cfg.seq_len}: the text read (--corpus-mb "
                         f"{cfg.corpus_mb:g}: {len(train_ids)} training and {len(val_ids)} "
                         f"validation characters) holds fewer than one window per rank; "
                         f"use a shorter --seq-len or a larger --corpus-mb")
    mcfg = ModelConfig(len(VOCAB), cfg.seq_len, cfg.dim, cfg.layers, cfg.heads)
    model = CharTransformer(mcfg)
    if cfg.uneven and cfg.uneven * (world - 1) >= cfg.steps:
        raise ValueError(f"--uneven {cfg.uneven}: rank {world - 1} would train no step of "
                         f"{cfg.steps}; use a smaller value")
    optimizer = _optimizer(cfg, model)
    # an elastic replacement, alone until admitted, takes the job's directory from rank 0
    # then (train_elastic): it must neither make a run directory nor be refused one
    run = (checkpoint.Run("", False, "joining the elastic job") if joining()
           else checkpoint.agree_on_run(cfg.out, cfg.resume))
    run_dir = [run.out]
    if lead and run.resume:
        preemption.clear_note(run.out)
    ckpt = run.checkpoint
    step, history, val_history, trained_on = 0, [], [], world
    if run.resume:
        state = checkpoint.load(ckpt)
        if state["model_config"] != dataclasses.asdict(mcfg):
            raise SystemExit(f"train_chars: {run.why}: {ckpt} holds a model "
                             f"{state['model_config']}, these flags build "
                             f"{dataclasses.asdict(mcfg)}")
        model.load_state_dict(state["model"])
        step, history, val_history = state["step"], state["history"], state["val_history"]
        trained_on = state.get("world_size", world)  # older checkpoints did not say
    sync = make_sync(cfg.sync, model, optimizer, cfg.inner_steps, cfg.fragments,
                     cfg.outer_lr, cfg.outer_momentum)
    optimizer = sync.optimizer  # local-sgd: the averaging optimizer around the AdamW
    if run.resume:  # after wrapping: local-sgd's state dict carries its averager's count
        optimizer.load_state_dict(state["optimizer"])
        sync.load_state_dict(state.get("sync", {}))
    ddp = sync.forward
    if cfg.shard_grads:
        shard_gradients(ddp, optimizer)  # type: ignore[arg-type]
    n_params = sum(p.numel() for p in model.parameters())
    if lead and not joining():  # a joining worker is alone until admitted
        print(f"train_chars: {world} ranks, {n_files} stdlib files ({len(train_ids) / 1e6:.2f}M "
              f"train / {len(val_ids) / 1e6:.2f}M val chars), {n_params / 1e6:.2f}M params, "
              f"global batch {cfg.batch_size * world} x {cfg.seq_len}, "
              f"{f'resuming at step {step} ({run.why})' if run.resume else 'from scratch'}; "
              f"{_describe(cfg)}; writing to {run.out}", flush=True)
        if run.why and not run.resume:
            print(f"train_chars: {run.why}", flush=True)
        if trained_on != world:
            print(f"train_chars: the checkpoint was trained on {trained_on} ranks and this run "
                  f"has {world}: the global batch changes from {cfg.batch_size * trained_on} "
                  f"to {cfg.batch_size * world} sequences per step (--batch-size is per "
                  f"rank), and the data order from here differs from a {trained_on}-rank "
                  f"run's", flush=True)

    windows = CharWindows(train_ids, cfg.seq_len)
    sampler = DistributedSampler(windows, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(windows, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)
    if not val_history or val_history[-1][0] != step:
        val_history.append((step, evaluate(model, val_ids, cfg)))
    val_start = val_history[-1][1]

    def save() -> None:  # every rank calls it; rank 0 writes
        checkpoint.save({"model": model.state_dict(),
                         "optimizer": _optimizer_state(optimizer, lead),
                         "step": step, "history": history, "val_history": val_history,
                         "model_config": dataclasses.asdict(mcfg),
                         "world_size": dist.get_world_size(),  # --elastic: it may change
                         "batch_size": cfg.batch_size, "sync": sync.state_dict()},
                        os.path.join(run_dir[0], "checkpoint.pt"))

    progress = Progress(cfg.steps, step, enabled=lead)
    first_step, started = step, time.monotonic()
    evaluating = 0.0  # seconds spent in periodic evaluations, left out of the training time
    val_curve = [(step, 0.0, val_start)]  # (step, training seconds, validation loss)

    def trained_for() -> float:
        return time.monotonic() - started - evaluating
    my_steps = cfg.steps - cfg.uneven * rank  # rank 0 trains them all
    if cfg.elastic:  # survive a lost rank in place (train_chars/elastic.py)
        def save_at(at: int, losses: list[Any]) -> None:
            nonlocal step, history
            step, history = at, losses
            save()

        step, history = train_elastic(
            cfg, ddp, optimizer, windows, step, history, progress, lambda s: _lr(cfg, s),
            lambda r, s: _step_seed(cfg.seed, r, s), _mean_over_ranks, save_at, run_dir)
        rank, world = dist.get_rank(), dist.get_world_size()  # the membership may differ
        lead = rank == 0
        run = dataclasses.replace(run, out=run_dir[0])
        ckpt = run.checkpoint
    joinables: list[Any] = [ddp]  # DDP first: its collectives come first in a step
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        joinables.append(optimizer)  # a joined rank still steps its shard and sends it
    preempted = False
    with Join(joinables) if cfg.uneven else contextlib.nullcontext():
        while step < my_steps and not preempted:
            epoch, skip = divmod(step, len(loader))
            sampler.set_epoch(epoch)
            for x, y in itertools.islice(loader, skip, None):
                torch.manual_seed(_step_seed(cfg.seed, rank, step))  # dropout, if enabled
                for group in optimizer.param_groups:
                    group["lr"] = _lr(cfg, step)
                loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if isinstance(optimizer, ZeroRedundancyOptimizer):
                    optimizer.clip_grad_norm_(1.0)  # the norm over every rank's shard
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                step += 1
                synced = sync.after_step(step)
                if cfg.uneven:  # no per-step collective here, so no preemption either
                    history.append((step, loss.item()))
                elif synced:  # local-sgd, diloco: only at syncs, as talking is what is saved
                    mean, preempted = preemption.mean_loss_and_stop(loss)
                    history.append((step, mean))
                else:
                    history.append((step, loss.item()))
                if cfg.eval_every and step % cfg.eval_every == 0 and step < my_steps:
                    at = time.monotonic()
                    val_curve.append((step, trained_for(), evaluate(model, val_ids, cfg)))
                    evaluating += time.monotonic() - at
                rate = (step - first_step) * cfg.batch_size * world / trained_for()
                progress.update(step, history[-1][1], rate)
                if (cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps
                        and not cfg.uneven):
                    save()
                if step >= my_steps or preempted:
                    break
    if preempted:
        progress.close()
        save()
        if lead:
            preemption.leave_note(run.out, step, cfg.steps)
        dist.barrier()
        return {"preempted_at": step}
    step = cfg.steps  # under Join every rank now holds rank 0's model, trained this far
    sync.finish()
    progress.close()
    elapsed = trained_for()
    val_end = evaluate(model, val_ids, cfg)
    val_curve.append((step, elapsed, val_end))
    if val_history[-1][0] != step:
        val_history.append((step, val_end))
    save()

    metrics: dict[str, Any] = {}
    if lead:
        tensors = _verify(ckpt, model, step)
        png = os.path.join(run.out, "loss.png")
        renderer = write_loss_png(png, history, val_history)
        gen = torch.Generator().manual_seed(cfg.seed)
        model.eval()
        sample = decode(model.generate(encode(b"def "), cfg.sample_chars, generator=gen))
        ran = step - first_step
        this_run = [loss for s, loss in history if s > first_step]  # after a resume too
        tail = this_run[-10:]
        metrics = {
            "world_size": world, "steps": step, "steps_this_run": ran,
            "train_loss_first": this_run[0] if this_run else None,
            "train_loss_last10": sum(tail) / len(tail) if tail else None,
            "val_loss_start": val_start, "val_loss_end": val_end, "val_history": val_history,
            "elapsed_s": elapsed, "val_curve": val_curve, "sync": cfg.sync,
            "inner_steps": cfg.inner_steps, "fragments": cfg.fragments,
            "outer_lr": cfg.outer_lr, "outer_momentum": cfg.outer_momentum,
            **sync.counters(),
            "samples_per_s": ran * cfg.batch_size * world / elapsed if ran else 0.0,
            "chars_per_s": ran * cfg.batch_size * world * cfg.seq_len / elapsed if ran else 0.0,
            "checkpoint": ckpt, "checkpoint_verified": True, "png": png, "renderer": renderer,
        }
        with open(os.path.join(run.out, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=1)
        print(f"done: {ran} steps in {elapsed:.0f} s, {metrics['samples_per_s']:.1f} samples/s "
              f"({metrics['chars_per_s']:.0f} chars/s) on {world} ranks")
        if this_run:
            print(f"loss: train {this_run[0]:.3f} -> {metrics['train_loss_last10']:.3f} "
                  f"(steps {first_step + 1}-{step}: the first, then the mean of the last "
                  f"{len(tail)}), validation {val_start:.3f} -> {val_end:.3f}")
        print(f"checkpoint: {ckpt} (step {step}) reloaded, {tensors} tensors verified")
        print(f"loss curve: {png} ({renderer}); metrics: "
              f"{os.path.join(run.out, 'metrics.json')}")
        print(f"sample:\n{'-' * 60}\n{sample}\n{'-' * 60}", flush=True)
    dist.barrier()
    return metrics
