"""A small GPT-style character language model (pre-norm transformer, causal attention)."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "CharTransformer"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    seq_len: int = 128
    dim: int = 128
    layers: int = 4
    heads: int = 4
    dropout: float = 0.0


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(),
                                 nn.Linear(4 * cfg.dim, cfg.dim))
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True,
                                             dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class CharTransformer(nn.Module):
    """Next-character logits for a batch of character ids ``(batch, time)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.dim))
        self.blocks = nn.Sequential(*[Block(cfg) for _ in range(cfg.layers)])
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size)
        self.apply(self._init)
        for m in self.modules():  # scaled residual projections, as in GPT-2
            if isinstance(m, Block):
                nn.init.normal_(m.proj.weight, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        logits: torch.Tensor = self.head(self.norm(self.blocks(x)))
        return logits

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, length: int, temperature: float = 0.8,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Extend the 1-D id tensor ``prompt`` by ``length`` sampled characters."""
        ids = prompt.clone()
        for _ in range(length):
            logits = self(ids[-self.cfg.seq_len:].unsqueeze(0))[0, -1] / temperature
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            ids = torch.cat([ids, nxt])
        return ids
