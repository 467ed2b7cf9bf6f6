"""A small mixture-of-experts language model (expert-parallel tests and
docs/parallelism.md): each block a dense layer, then routed experts as 3-D
parameters, sharded over ``ep`` ranks by :func:`enable_expert_parallel`
with tokens moved by ``all_to_all_single``, as torchtitan. Uneven shapes.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

VOCAB, D, HIDDEN, SEQ = 29, 6, 10, 5
N_EXPERTS, TOP_K = 4, 2
N_BLOCKS = 2
PER_RANK = 3
SEED = 4321


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` whose backward sends gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Experts(nn.Module):
    """``N_EXPERTS`` MLPs as ``w1 (E, D, HIDDEN)``, ``w2 (E, HIDDEN, D)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(N_EXPERTS, D, HIDDEN) * D ** -0.5)
        self.w2 = nn.Parameter(torch.randn(N_EXPERTS, HIDDEN, D) * HIDDEN ** -0.5)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w2 = _local(self.w1), _local(self.w2)
        outs = [torch.tanh(chunk @ w1[e]) @ w2[e]
                for e, chunk in enumerate(torch.split(x, counts))]
        return torch.cat(outs)


class MoE(nn.Module):
    """Router (top-``TOP_K`` of softmax scores) and the routed experts."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, N_EXPERTS, bias=False)
        self.experts = Experts()
        self.ep_group: Optional[dist.ProcessGroup] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, D)
        weights, chosen = F.softmax(self.router(tokens), dim=-1).topk(TOP_K, dim=-1)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        routed = tokens.repeat_interleave(TOP_K, dim=0)[order]
        counts = torch.bincount(flat, minlength=N_EXPERTS)
        out_sorted = self._run_experts(routed, counts)
        out = torch.empty_like(out_sorted).index_copy(0, order, out_sorted)
        mixed = (out.view(-1, TOP_K, D) * weights.unsqueeze(-1)).sum(dim=1)
        return x + mixed.view_as(x)

    def _run_experts(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep_group is None:
            return self.experts(routed, counts.tolist())
        ep = dist.get_world_size(self.ep_group)
        local_n = N_EXPERTS // ep
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.ep_group)
        by_source = received_counts.view(ep, local_n)  # [source rank, local expert]
        send = counts.view(ep, local_n).sum(dim=1).tolist()
        receive = by_source.sum(dim=1).tolist()
        received = _AllToAll.apply(routed, receive, send, self.ep_group)
        pieces = torch.split(received, by_source.reshape(-1).tolist())
        by_expert = torch.cat([pieces[s * local_n + e] for e in range(local_n) for s in range(ep)])
        done = self.experts(by_expert, by_source.sum(dim=0).tolist())
        done_pieces = torch.split(done, by_source.t().reshape(-1).tolist())
        back = torch.cat([done_pieces[e * ep + s] for s in range(ep) for e in range(local_n)])
        return _AllToAll.apply(back, send, receive, self.ep_group)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(D, D)
        self.moe = MoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x + torch.tanh(self.dense(x)))


class TinyMoELM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.norm(h))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())


def build_moe() -> TinyMoELM:
    torch.manual_seed(SEED)
    return TinyMoELM()


def enable_expert_parallel(model: TinyMoELM, ep_mesh: DeviceMesh) -> None:
    """``w1``/``w2`` become ``DTensor`` parameters ``Shard(0)`` over
    ``ep_mesh`` (every rank built the same global values)."""
    for block in model.blocks:
        experts = block.moe.experts
        for name in ("w1", "w2"):
            full = getattr(experts, name).detach()
            local = distribute_tensor(full, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(local))
        block.moe.ep_group = ep_mesh.get_group()


def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(77 + step)
    return torch.randint(VOCAB, (n, SEQ), generator=g), torch.randint(VOCAB, (n, SEQ), generator=g)
