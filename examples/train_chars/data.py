"""The corpus: Python's own standard library source, as character ids. No download.

Files are chosen deterministically (ordered by a hash of their relative path, so the
mix spans many packages) until ``max_bytes`` are collected; every rank computes the
same selection. The last ``val_fraction`` of the files (not of the characters) is
held out for validation, so validation text is code the model has not seen.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig

import torch
from torch.utils.data import Dataset

__all__ = ["VOCAB", "encode", "decode", "load_corpus", "CharWindows"]

# id 0: any other byte (tabs, non-ASCII); id 1: newline; then printable ASCII
VOCAB = "\ufffd\n" + "".join(chr(c) for c in range(32, 127))
_LUT = torch.zeros(256, dtype=torch.long)
for _i, _ch in enumerate(VOCAB[1:], start=1):
    _LUT[ord(_ch)] = _i

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def encode(data: bytes) -> torch.Tensor:
    """Bytes to a 1-D tensor of character ids."""
    if not data:
        return torch.zeros(0, dtype=torch.long)
    return _LUT[torch.frombuffer(bytearray(data), dtype=torch.uint8).long()]


def decode(ids: torch.Tensor) -> str:
    return "".join(VOCAB[i] for i in ids.tolist())


def _stdlib_files(root: str) -> list[str]:
    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        found += [os.path.relpath(os.path.join(here, f), root) for f in files if f.endswith(".py")]
    return sorted(found, key=lambda rel: hashlib.sha1(rel.encode()).hexdigest())


def load_corpus(max_bytes: int, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Return (train ids, validation ids, number of files read)."""
    root = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for rel in _stdlib_files(root):
        if total >= max_bytes:
            break
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
    if not chunks:
        raise RuntimeError(f"no .py files found under the stdlib directory {root}")
    n_val = max(1, round(len(chunks) * val_fraction))
    train = b"\n".join(chunks[:-n_val]) if len(chunks) > n_val else chunks[0]
    return encode(train), encode(b"\n".join(chunks[-n_val:])), len(chunks)


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of ``seq_len`` inputs and their next-character targets."""

    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        self.ids = ids
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.ids) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq_len
        window = self.ids[start:start + self.seq_len + 1]
        return window[:-1], window[1:]
