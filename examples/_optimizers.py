"""The demo's optimizers: AdamW with nanoGPT's decay groups, or torch's Muon
on the blocks' weight matrices (each whole on one rank: placement
``"owned"``) and AdamW on the rest; a warmup-cosine schedule for each.
Used by ``train_gpt.py``."""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from fsdp_compose import flat_step, param_info


def lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warmup over ``warmup`` steps, then cosine from 1 to ``min_ratio``."""
    def factor(done: int) -> float:
        if done < warmup:
            return (done + 1) / warmup
        progress = min(1.0, (done - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor



def original_shape(p: torch.Tensor) -> torch.Size:
    """The full shape: an fsdp_compose parameter is this rank's piece
    (its rows under the default placement, 1-D under ``"flat"``), so ask
    ``param_info``, right under every placement (DDP's are whole, FSDP2's
    DTensors report the global shape)."""
    info = param_info(p)
    return info.shape if info is not None else p.shape


def _owned_matrices(param: nn.Parameter) -> Optional[str]:
    """``shard_placement_fn`` for Muon: the blocks' weight matrices whole."""
    return "owned" if param.ndim == 2 else None


def muon_params(model: nn.Module) -> list[nn.Parameter]:
    """The hidden weight matrices (the blocks' 2-D weights): Muon's share;
    embeddings, head, norms and biases stay with AdamW."""
    blocks = model.module.blocks if hasattr(model, "module") else model.blocks
    return [p for p in blocks.parameters() if len(original_shape(p)) == 2]


class Optimizers:
    """Several optimizers stepped as one (torch's state-dict functions take
    the list ``optimizers``)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = list(optimizers)

    def step(self) -> None:
        for optim in self.optimizers:
            optim.step()

    def zero_grad(self) -> None:
        for optim in self.optimizers:
            optim.zero_grad()


def flat_summary(optims: Optimizers) -> str:
    """``"AdamW step: 8 flat tensors for 41 parameters"``: what the flat
    optimizer step (fsdp_compose's default) passed to torch's functional
    AdamW at the last step, on this rank."""
    adamw = [o for o in optims.optimizers if type(o) is torch.optim.AdamW]
    reports = [flat_step(o).last for o in adamw]  # the handle the default made at step 1
    if not reports or any(r is None for r in reports):
        return "AdamW step: torch's (no flat step yet)"
    tensors = sum(r.flat_tensors for r in reports if r is not None)
    params = sum(r.flat_params for r in reports if r is not None)
    return f"AdamW step: {tensors} flat tensors for {params} parameters"


class Schedulers:
    """One LR schedule per optimizer of :class:`Optimizers`, stepped together."""

    def __init__(self, schedulers: list[torch.optim.lr_scheduler.LRScheduler]) -> None:
        self.schedulers = schedulers

    def step(self) -> None:
        for sched in self.schedulers:
            sched.step()

    def state_dict(self) -> dict[str, Any]:
        return {str(i): sched.state_dict() for i, sched in enumerate(self.schedulers)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, sched in enumerate(self.schedulers):
            sched.load_state_dict(state[str(i)])


def build_optimizer(args: argparse.Namespace, model: nn.Module) -> tuple[Optimizers, Schedulers]:
    """AdamW (weight decay on the matrices, as nanoGPT), or with ``--optimizer
    muon`` torch's Muon on the blocks' weight matrices and AdamW on the rest;
    a warmup-cosine schedule for each."""
    matrices = muon_params(model) if args.optimizer == "muon" else []
    taken = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in taken]
    decay = [p for p in rest if len(original_shape(p)) >= 2]
    no_decay = [p for p in rest if len(original_shape(p)) < 2]
    optims = [torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)]
    if matrices:
        muon = torch.optim.Muon(matrices, lr=args.muon_lr, weight_decay=0.1,
                                adjust_lr_fn="match_rms_adamw")
        flat_step(muon, enabled=False)  # no flat step for Muon: torch's, without the notice
        optims.append(muon)
    schedule = lr_lambda(args.warmup, args.decay_steps or args.steps, args.min_lr_ratio)
    return Optimizers(*optims), Schedulers([torch.optim.lr_scheduler.LambdaLR(o, schedule)
                                            for o in optims])

