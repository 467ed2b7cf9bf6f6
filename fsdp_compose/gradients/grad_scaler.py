"""Loss scaling for sharded gradients: ``torch.amp.GradScaler`` finds inf/nan
only in this rank's shards, so the ranks' scales would drift apart.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/nan verdict is agreed across ranks (a
    MAX all-reduce of ``found_inf``), so a step is skipped and the scale backed
    off on every rank together::

        scaler = ShardedGradScaler("cuda")        # or "cpu" (gloo)
        scaler.scale(loss).backward()
        scaler.unscale_(optim)                     # optional
        scaler.step(optim)
        scaler.update()

    Args:
        device: any device type torch's scaler takes; ``None``: ``"cuda"`` when
            available, else ``"cpu"``.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as
            in ``torch.amp.GradScaler``.
        process_group: the ranks that must agree; ``None``: the default group
            (uninitialised: a plain ``GradScaler``).

    Every rank joins the check, with or without gradients. As in torch,
    ``unscale_`` refuses float16 gradients: keep fp32 parameters."""

    def __init__(self, device: Optional[str] = None, init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True,
                 process_group: Optional[dist.ProcessGroup] = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
        self.process_group = process_group

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        """Torch's check and unscale of the local gradients, then one agreed flag."""
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        agreed = torch.zeros((), dtype=torch.float32, device=found_inf.device)
        for flag in per_device.values():
            torch.maximum(agreed, flag.to(agreed.device), out=agreed)
        self._all_reduce_max(agreed)
        return {agreed.device: agreed}

    def _all_reduce_max(self, flag: torch.Tensor) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if dist.get_world_size(group) == 1:
            return
        if flag.device.type == "cpu" and dist.get_backend(group) == "nccl":
            on_device = flag.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=group)
            flag.copy_(on_device)
        else:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
