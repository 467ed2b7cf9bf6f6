"""Training with torch FSDP2, as a framework writes it: ``parallelize`` on a
meta-device model, whole-value initialisation, a loss normalised by the
global token count, clipping with torch's ``clip_grad_norm_``.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2_migration/train_fsdp2.py

``train_fsdp_compose.py`` is the same script ported to fsdp_compose;
``docs/migrating-from-fsdp2.md`` explains every changed line.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.experimental import implicit_replication

from migration_model import VOCAB, Transformer


def parallelize(model: Transformer) -> Transformer:
    mp_policy = MixedPrecisionPolicy(torch.float32, torch.float32)  # bf16, fp32 on GPUs
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    return model


def disable_gradient_division(model: Transformer) -> None:
    # the loss is already divided by the global token count: sum the gradients
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (2 * world, 9), generator=g)
    targets = tokens.roll(-1, dims=1)
    targets[torch.rand(targets.shape, generator=g) < 0.3] = -100  # padding: counts differ by rank
    return tokens[2 * rank:2 * rank + 2], targets[2 * rank:2 * rank + 2]


def train(steps: int = 5, seed: int = 0) -> dict[str, list[float]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        model = Transformer()
    parallelize(model)
    disable_gradient_division(model)
    model.to_empty(device="cpu")
    with torch.no_grad(), implicit_replication():
        model.init_weights(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, grad_norms = [], []
    for step in range(steps):
        tokens, targets = batch(step, rank, world)
        global_tokens = (targets != -100).sum()
        dist.all_reduce(global_tokens)
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        loss = loss / global_tokens
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        grad_norm = grad_norm.full_tensor()
        optim.step()
        optim.zero_grad()
        dist.all_reduce(loss.detach())  # the global loss, for logging
        losses.append(loss.item())
        grad_norms.append(grad_norm.item())
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f} grad_norm {grad_norm.item():.6f}")
    return {"losses": losses, "grad_norms": grad_norms}


if __name__ == "__main__":
    dist.init_process_group("gloo")
    train()
    dist.destroy_process_group()
