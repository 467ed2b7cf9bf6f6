"""Empty optimizer parameter groups: named once, and a resume that works.

A group filled by a selection rule (``[p for p in params if p.dim() >= 2]``,
Muon's ``p.ndim == 2``) that picks nothing is legal for torch's optimizers,
but it usually means the rule did not see what the user expected (under
``placement="flat"`` every parameter is 1-D between steps), and it breaks a
resume: torch's ``set_optimizer_state_dict`` (and so every
``torch.distributed.checkpoint`` resume) keys hyperparameters by parameter
FQN, so an empty group comes back without them and the next ``step()``
fails far from the cause (AdamW: ``KeyError: 'betas'``).

For an optimizer that holds parameters of ``fully_shard`` units, a step
pre-hook (installed once per process by ``fully_shard``):

* warns once, on rank 0, at the first step, naming each empty group by its
  index and hyperparameters, unless the groups were filled by a rule on
  parameter names (:func:`groups_chosen_by_name`: a name is the same
  whatever the placement, so an empty group there is the rule's intent,
  e.g. Hugging Face's no-decay group for a LoRA model);
* before every step, gives an empty group that lacks a hyperparameter the
  optimizer's ``defaults`` (a group of no parameter changes no number; this
  only lets ``step()`` run).

Cost per step: one pass over the optimizer's groups.
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
"""Optimizer -> whether it holds managed parameters (looked at once)."""
_chosen_by_name: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()


def groups_chosen_by_name(optimizer: Optimizer) -> None:
    """Tell the check that ``optimizer``'s groups were filled by a rule on
    parameter names, which sharding cannot mislead: an empty group is not
    warned about (its hyperparameters are still filled before each step)."""
    _chosen_by_name.add(optimizer)


def install_empty_group_check() -> None:
    """Install the step pre-hook (once per process)."""
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
    """The group's hyperparameters that differ from the defaults (the
    learning rate aside: a scheduler or an initialisation step changes it)."""
    differing = [f"{key}={value}" for key, value in group.items()
                 if key not in ("params", "lr") and defaults.get(key) != value]
    return f" ({', '.join(differing)})" if differing else ""


def _fill_empty_groups(optimizer: Optimizer) -> None:
    for group in optimizer.param_groups:
        if not group["params"]:
            for key, value in optimizer.defaults.items():
                group.setdefault(key, value)
