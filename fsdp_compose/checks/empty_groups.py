"""Empty optimizer parameter groups: named once, and a resume that works.

A group whose rule picked nothing (``p.dim() >= 2`` under
``placement="flat"``) usually means the rule missed, and breaks a resume:
hyperparameters are keyed by parameter FQN, so the empty group comes back
without them (AdamW: ``KeyError: 'betas'``). A step pre-hook warns once on
rank 0 naming each empty group (unless :func:`groups_chosen_by_name`), and
fills an empty group's missing hyperparameters from ``defaults``.
"""

from __future__ import annotations

import warnings
import weakref

import torch.distributed as dist
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..runtime.owners import owner_of

_installed: list[object] = []
_seen: "weakref.WeakKeyDictionary[Optimizer, bool]" = weakref.WeakKeyDictionary()
"""Optimizer -> whether it holds managed parameters."""
_chosen_by_name: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()


def groups_chosen_by_name(optimizer: Optimizer) -> None:
    """Declare that ``optimizer``'s groups were chosen by parameter name (which
    sharding cannot mislead): no warning for an empty group."""
    _chosen_by_name.add(optimizer)


def install_empty_group_check() -> None:
    if not _installed:
        _installed.append(register_optimizer_step_pre_hook(_before_step))


def _before_step(optimizer: Optimizer, args: object, kwargs: object) -> None:
    managed = _seen.get(optimizer)
    if managed is None:
        managed = _seen[optimizer] = any(owner_of(p) is not None
                                         for group in optimizer.param_groups
                                         for p in group["params"])
        if managed and optimizer not in _chosen_by_name:
            _warn_empty(optimizer)
    if managed:
        _fill_empty_groups(optimizer)


def _warn_empty(optimizer: Optimizer) -> None:
    empty = [i for i, group in enumerate(optimizer.param_groups) if not group["params"]]
    if not empty or (dist.is_initialized() and dist.get_rank() != 0):
        return
    named = "; ".join(f"group {i}{_differing(optimizer.param_groups[i], optimizer.defaults)}"
                      for i in empty)
    warnings.warn(
        f"fsdp_compose: {type(optimizer).__name__} has empty parameter group(s): {named}. "
        "The rule that fills them picked no parameter: check it against what a parameter "
        "looks like between steps (p.shape is this rank's piece; under placement='flat' "
        "p.dim() is 1: use len(fsdp_compose.param_info(p).shape)). A resume through "
        "torch.distributed.checkpoint drops an empty group's hyperparameters; fsdp_compose "
        "fills them from the optimizer's defaults before each step.", stacklevel=4)


def _differing(group: dict, defaults: dict) -> str:
    """The group's hyperparameters that differ from the defaults (not the
    learning rate: schedulers change it)."""
    differing = [f"{key}={value}" for key, value in group.items()
                 if key not in ("params", "lr") and defaults.get(key) != value]
    return f" ({', '.join(differing)})" if differing else ""


def _fill_empty_groups(optimizer: Optimizer) -> None:
    for group in optimizer.param_groups:
        if not group["params"]:
            for key, value in optimizer.defaults.items():
                group.setdefault(key, value)
