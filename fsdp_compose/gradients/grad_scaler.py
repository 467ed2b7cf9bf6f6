"""Loss scaling for sharded gradients.

``torch.amp.GradScaler`` looks for inf/nan only in the gradients it can see.
After ``fully_shard`` each rank sees only its own shard of every gradient, so
one rank may find an inf that the others do not, and plain ``GradScaler``
would then skip the step on that rank alone and lower the scale there alone:
the ranks' parameters and scales drift apart silently.

:class:`ShardedGradScaler` agrees on the verdict: after checking (and
unscaling) its local gradients, each rank all-reduces its ``found_inf`` flag
with MAX over the process group, so an inf/nan on any rank skips the step on
every rank and backs the scale off on every rank. Everything else is
``torch.amp.GradScaler``: same arguments, same ``scale`` / ``unscale_`` /
``step`` / ``update`` / ``state_dict`` / ``load_state_dict``, and the scale
(hence the state dict) stays identical on every rank.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/nan check is agreed across ranks.

    Use it exactly like ``torch.amp.GradScaler``::

        scaler = ShardedGradScaler("cuda")        # or "cpu" (gloo)
        scaler.scale(loss).backward()
        scaler.unscale_(optim)                     # optional, e.g. before clipping:
        clip_grad_norm_(model, 1.0)                # fsdp_compose.clip_grad_norm_
        scaler.step(optim)                         # skipped on EVERY rank if ANY rank saw inf/nan
        scaler.update()                            # the same new scale on every rank

    Args:
        device: ``"cuda"`` or ``"cpu"`` (any device type torch's scaler
            takes); ``None``: ``"cuda"`` when CUDA is available, else
            ``"cpu"``. Unlike torch, the default never silently disables the
            scaler on a machine without CUDA.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled:
            as in ``torch.amp.GradScaler``.
        process_group: the ranks that must agree (all ranks that shard the
            optimizer's parameters); ``None``: the default process group at
            the time of the check. Without an initialised process group (one
            process) it behaves exactly like ``torch.amp.GradScaler``.

    Invariants:
        * after every ``unscale_`` (explicit, or inside ``step``) the
          optimizer's ``found_inf`` is the MAX over all ranks of the local
          flags, so ``step`` runs or skips ``optimizer.step()`` on all ranks
          together and ``update`` computes the same scale everywhere;
        * a rank that holds no gradient for the optimizer (it owns no element
          of any of its parameters) still joins the check, with flag 0.

    Cost:
        one all-reduce of one float32 scalar per optimizer per step (in
        ``unscale_``, or in ``step`` when ``unscale_`` was not called); the
        ``step`` then reads the agreed flag on the host, like torch's scaler.
        With NCCL a CPU flag is moved to the current CUDA device for the
        collective.

    Notes:
        On CPU this relies on ``torch._amp_foreach_non_finite_check_and_unscale_``
        and ``torch._amp_update_scale_`` having CPU kernels, which they do in
        the torch versions this package supports (>= 2.11). As in torch,
        float16 *gradients* are refused by ``unscale_``; ``fully_shard``
        keeps sharded gradients in the parameters' dtype, so keep fp32
        parameters (a ``MixedPrecisionPolicy`` computes in fp16 without
        making the gradients fp16).
    """

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
        """Check/unscale the local gradients (torch's code), then agree on
        one flag: every caller (``unscale_``, and ``_check_inf_per_device``
        for optimizers with built-in scaling support) goes through here."""
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
