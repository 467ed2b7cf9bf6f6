"""Optimizer state made without a step, for torch's AdamW, Adam and SGD over
managed parameters: torch's own ``_init_group``, given stand-in gradients
that hold no memory, creates what the first step creates (SGD with momentum
gets a zero ``momentum_buffer``), so a checkpoint has entries to land in.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from .._torch_private import init_optimizer_group
from ..runtime.owners import owner_of

_LISTS = {torch.optim.AdamW: 6, torch.optim.Adam: 6, torch.optim.SGD: 3}
"""The lists each class's ``_init_group`` fills, after the group."""


def make_first_step_state(optim: Optimizer) -> bool:
    """Give a never-stepped ``optim`` its first step's state before computing
    (zero moments, ``step`` 0); stepping from it is stepping a fresh
    optimizer. Returns whether state was made (not for another class, or an
    SGD with dampening)."""
    params = [p for group in optim.param_groups for p in group["params"]]
    if optim.state or any(p.grad is not None for p in params):
        return False  # stepped (or being stepped)
    if not makes_state_directly(optim, params) or (type(optim) is torch.optim.SGD and any(
            g["momentum"] != 0 and g["dampening"] != 0 for g in optim.param_groups)):
        return False
    make_state(optim, zero_step=False)
    return bool(optim.state)


def makes_state_directly(optim: Optimizer, params: list[torch.Tensor]) -> bool:
    return type(optim) in _LISTS and not any(p.is_complex() for p in params) and \
        any(owner_of(p) is not None for p in params)


def make_state(optim: Optimizer, zero_step: bool) -> None:
    """torch's ``_init_group`` over stand-in gradients, plus SGD's zero
    ``momentum_buffer``; ``zero_step``: ``step`` 1."""
    lists = _LISTS[type(optim)]
    trained = [p for group in optim.param_groups for p in group["params"] if p.requires_grad]
    zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
    try:
        for p in trained:
            zero = zeros.setdefault((p.dtype, p.device), torch.zeros((), dtype=p.dtype,
                                                                       device=p.device))
            p.grad = zero.expand_as(p)
        with torch.no_grad():
            for group in optim.param_groups:
                init_optimizer_group(optim, group, lists)
                if type(optim) is torch.optim.SGD and group["momentum"] != 0:
                    for p in group["params"]:
                        if p.grad is not None:
                            optim.state[p]["momentum_buffer"] = torch.zeros_like(
                                p, memory_format=torch.preserve_format)
            if zero_step:
                for p in trained:
                    step = optim.state.get(p, {}).get("step")
                    if step is not None:
                        step.add_(1)
    finally:
        for p in trained:
            p.grad = None
