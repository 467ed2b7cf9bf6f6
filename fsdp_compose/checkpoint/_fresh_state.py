"""Optimizer state made without a step, for torch's AdamW, Adam and SGD
over parameters ``fully_shard`` manages: torch's own ``_init_group`` on
each group, given a stand-in gradient that holds no memory (a zero scalar
expanded to the parameter's shape), creates what the first step creates
(``step``'s dtype and device for capturable and fused, ``amsgrad``'s
``max_exp_avg_sq``, the fused device check); SGD with momentum gets the zero
``momentum_buffer`` a zero step would have cloned from a zero gradient.

Two uses: torch's state initialisation without its zero step
(``_init_state.py``: ``step`` then counts that step, 1), and the state a
fresh optimizer's first step starts from (:func:`make_first_step_state`:
``step`` 0; stepping from it is stepping a fresh optimizer), which a
registered optimizer's ``state_dict()`` makes when it never stepped
(``_optim.register_optimizer``) so that a checkpoint loaded into that
state dict has entries to land in.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from .._torch_private import init_optimizer_group
from ..runtime.owners import owner_of

_LISTS = {torch.optim.AdamW: 6, torch.optim.Adam: 6, torch.optim.SGD: 3}
"""The lists each class's ``_init_group`` fills, after the group."""


def make_first_step_state(optim: Optimizer) -> bool:
    """Give a never-stepped ``optim`` the state its first step would make
    before computing (AdamW, Adam: zero moments, ``step`` 0; SGD with
    momentum and no dampening: a zero ``momentum_buffer``), so that its
    ``state_dict()`` has entries a checkpoint can be loaded into. Stepping
    from that state is stepping a fresh optimizer: the first step finds the
    values its own ``_init_group`` would have made. Returns whether state
    was made (False: stepped already, or another optimizer class, or an
    SGD whose dampening makes a zero buffer differ from none)."""
    params = [p for group in optim.param_groups for p in group["params"]]
    if optim.state or any(p.grad is not None for p in params):
        return False  # stepped (or being stepped): its state is what it is
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
    ``momentum_buffer``; ``zero_step``: count the zero step as taken
    (``step`` 1, what torch's initialisation leaves)."""
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
                        step.add_(1)  # what the zero step counts
    finally:
        for p in trained:
            p.grad = None
