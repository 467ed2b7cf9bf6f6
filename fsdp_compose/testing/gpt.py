"""A small GPT-style decoder and synthetic next-token data, shared by the
tests, examples and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Model size; tiny and uneven (97-token vocabulary) so buffers pad."""

    vocab_size: int = 97
    seq_len: int = 16
    d_model: int = 24
    n_heads: int = 3
    n_layers: int = 3
    mlp_ratio: int = 4
    tie_embeddings: bool = False


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        # no qkv bias: the key bias's gradient is exactly zero (Adam amplifies noise)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Embeddings, ``n_layers`` pre-norm blocks, final norm and head (tied if asked)."""

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_tokens(step: int, batch: int, seq_len: int, vocab_size: int,
                     seed: int = 0, noise: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch ``(inputs, targets)`` of period-5 token
    patterns with ``noise`` of the tokens random."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    pattern = torch.randint(vocab_size, (5,), generator=torch.Generator().manual_seed(seed))
    start = torch.randint(5, (batch, 1), generator=g)
    index = (start + torch.arange(seq_len + 1)) % 5
    tokens = pattern[index]
    flip = torch.rand(tokens.shape, generator=g) < noise
    tokens = torch.where(flip, torch.randint(vocab_size, tokens.shape, generator=g), tokens)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train_losses(model: GPT, optimizer: torch.optim.Optimizer,
                 batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Train one step per batch and return each step's loss (the plain loop
    sharded runs are compared with)."""
    losses = []
    for inputs, targets in batches:
        loss = model.loss(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
