"""Train a small GPT-style model with fsdp_compose on CPU ranks.

    # two CPU ranks on this machine (what `make demo` runs)
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py
    # one node with GPUs: NCCL is picked automatically when CUDA is available
    torchrun --standalone --nproc-per-node 8 examples/train_gpt.py --layers 12 --width 768
    # two nodes
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-endpoint HOST:29500 examples/train_gpt.py

Every block is its own unit, then the root; the optimizer is a plain AdamW
with decay/no-decay groups built from the parameters' original shapes.
Losses printed by rank 0 are the mean over all ranks.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from fsdp_compose import fully_shard, param_info
from fsdp_compose.testing import GPT, GPTConfig, init_from_torchrun, synthetic_tokens


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = init_from_torchrun()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.width,
                    n_heads=args.heads, n_layers=args.layers)
    torch.manual_seed(0)  # every rank builds the same initial model
    model = GPT(cfg).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

    decay = [p for p in model.parameters() if len(param_info(p).shape) >= 2]
    no_decay = [p for p in model.parameters() if len(param_info(p).shape) < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                               {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    if rank == 0:
        total = sum(param_info(p).numel for p in model.parameters())
        local = sum(p.numel() for p in model.parameters())
        print(f"{world} ranks on {device}: {total / 1e6:.2f}M parameters, "
              f"{local / 1e6:.2f}M on this rank")

    per = args.batch_per_rank
    for step in range(args.steps):
        x, y = synthetic_tokens(step, per * world, cfg.seq_len, cfg.vocab_size)
        x, y = x[rank * per:(rank + 1) * per].to(device), y[rank * per:(rank + 1) * per].to(device)
        loss = model.loss(x, y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
