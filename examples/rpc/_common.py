"""What the RPC examples share: starting their workers, and their data.

Every example runs either standalone (``python examples/rpc/<name>.py`` starts its own
workers with ``torch.multiprocessing.spawn`` and env:// rendezvous on a free port of
this host) or under a launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
(``python -m tandem.run --standalone --nproc-per-node N examples/rpc/<name>.py``), in
which case each process is one worker.

The data is Python's own standard library source as characters (no download), read
by ``examples/train_chars/data.py``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: train_chars

from train_chars.data import VOCAB, load_corpus  # noqa: E402

__all__ = ["launch", "text", "windows", "VOCAB"]

Worker = Callable[[int, int, argparse.Namespace], None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(rank: int, worker: Worker, world: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    worker(rank, world, args)


def launch(worker: Worker, world: int, args: argparse.Namespace) -> None:
    """Run ``worker(rank, world, args)`` on every worker of the job (see the docstring)."""
    if "RANK" in os.environ:
        size = int(os.environ["WORLD_SIZE"])
        if size != world:
            raise SystemExit(f"this example needs {world} processes, the launcher started {size}")
        _run(int(os.environ["RANK"]), worker, world, args)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("EXAMPLE_PG_PORT", str(_free_port()))
    torch.multiprocessing.spawn(_run, args=(worker, world, args), nprocs=world)


def text(max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) character ids of the stdlib source."""
    train, val, _ = load_corpus(max_bytes)
    return train, val


def windows(ids: torch.Tensor, context: int, count: int, offset: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` examples from ``offset``: ``context`` characters and the one after them."""
    starts = torch.arange(offset, offset + count) % (len(ids) - context - 1)
    x = torch.stack([ids[s:s + context] for s in starts.tolist()])
    return x, ids[starts + context]
