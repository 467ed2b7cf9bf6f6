"""Which parameter's gradient went non-finite first, agreed by every rank (a
NaN on one rank's shard alone must not raise there alone): one MIN
all-reduce of one integer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .._torch_private import foreach_norm
from ..runtime.owners import owner_of


def check_finite_gradients(module: nn.Module) -> None:
    """Raise ``RuntimeError`` on every rank naming the first parameter of
    ``module`` (``named_parameters()`` order) whose gradient holds a nan or
    inf on some rank. Collective when ``module`` has managed parameters: call
    it on every rank after backward."""
    named = list(module.named_parameters())
    group = next((entry.unit.group for _, p in named if (entry := owner_of(p)) is not None), None)
    world, rank = (group.world_size, group.rank) if group is not None else (1, 0)
    device = group.device if group is not None else torch.device("cpu")
    nothing = len(named) * world  # larger than every code below: nothing found
    grads, positions = [], []
    for position, (_, param) in enumerate(named):
        if param.grad is not None and param.grad.numel():
            grads.append(param.grad)
            positions.append(position)
    code = torch.tensor(nothing, dtype=torch.int64, device=device)
    if grads:
        peaks = torch.stack([p.to(device, torch.float32)
                             for p in foreach_norm(grads, float("inf"))])
        codes = torch.tensor(positions, dtype=torch.int64, device=device) * world + rank
        code = torch.where(torch.isfinite(peaks), nothing, codes).min()
    if world > 1:
        dist.all_reduce(code, op=dist.ReduceOp.MIN, group=group.process_group)
    found = int(code.item())
    if found == nothing:
        return
    position, bad_rank = divmod(found, world)
    raise RuntimeError(
        f"the gradient of parameter '{named[position][0]}' is not finite (nan or inf in rank "
        f"{bad_rank}'s shard); every parameter before it in named_parameters() order has finite "
        "gradients. Skip this step (optimizer.zero_grad() without optimizer.step()) and look "
        "for the cause: a loss that overflowed, a learning rate too high (clip gradients), or "
        "fp16 without ShardedGradScaler.")
