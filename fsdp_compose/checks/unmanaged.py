"""Refuse the forgotten root: at an optimizer's first step with gradients,
name every parameter with a gradient that nothing reduces across ranks (no
unit, no ``DTensor``, no DDP or ``replicate``, not
:func:`mark_reduced_elsewhere`): each rank would step on its own gradient
and the replicas drift silently. Local: a step pre-hook cannot know every
rank steps the same optimizer.
"""

from __future__ import annotations

import sys
import weakref
from typing import Iterable, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._naming import outermost_ancestors, qualified_names
from ..runtime.owners import owner_of
from .replicate import is_replicated

_installed: list[object] = []
_looked_at: "weakref.WeakKeyDictionary[Optimizer, bool]" = weakref.WeakKeyDictionary()
_reduced_elsewhere: dict[int, torch.Tensor] = {}
"""Parameters the user marked, held strongly (a weak reference would stop
``swap_tensors``; an id could be reused)."""
_SHOWN = 8  # parameters named in the message


def mark_reduced_elsewhere(module_or_params: Union[nn.Module, Iterable[torch.Tensor]]) -> None:
    """Declare that these parameters (a module's, or those given), which no
    unit manages, have their gradients reduced across ranks by other code,
    so the optimizer's first step does not refuse them. Call it on every rank
    before the first step."""
    params = module_or_params.parameters() if isinstance(module_or_params, nn.Module) \
        else module_or_params
    _forget_dropped()
    for param in params:
        _reduced_elsewhere[id(param)] = param


def _forget_dropped() -> None:
    for key in list(_reduced_elsewhere):
        if sys.getrefcount(_reduced_elsewhere[key]) <= 2:  # the dict and this call's argument
            del _reduced_elsewhere[key]


def install_unmanaged_check() -> None:
    if not _installed:
        _installed.append(register_optimizer_step_pre_hook(_look_once))


def _look_once(optimizer: Optimizer, args: object, kwargs: object) -> None:
    if optimizer in _looked_at:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    managed = next((owner for owner in map(owner_of, params) if owner is not None), None)
    if managed is None:
        _looked_at[optimizer] = True
        return  # not the optimizer of a fully_shard model
    if not any(p.grad is not None for p in params):
        return  # no backward yet (a step with a closure): look at a later step
    _looked_at[optimizer] = True
    _forget_dropped()
    if not dist.is_initialized() or managed.unit.group.total_size == 1:
        return  # one copy of the model: nothing drifts
    loose = [p for p in params if p.grad is not None and owner_of(p) is None
             and not isinstance(p, DTensor) and id(p) not in _reduced_elsewhere]
    names: dict[int, str] = {}
    if loose:
        tops = outermost_ancestors(m for owner in map(owner_of, params) if owner is not None
                                   for m in owner.unit.modules)
        names = qualified_names(tops)
        reduced = _reduced_by_other_apis(tops)
        loose = [p for p in loose if id(p) not in reduced]
    if loose:
        raise RuntimeError(_message(loose, names))


def _reduced_by_other_apis(tops: list[nn.Module]) -> set[int]:
    reduced: set[int] = set()
    for top in tops:
        for module in top.modules():
            if issubclass(type(module), DistributedDataParallel) or is_replicated(module):
                reduced.update(id(p) for p in module.parameters())
    return reduced


def _message(loose: list[torch.Tensor], names: dict[int, str]) -> str:
    shown = [f"'{names[id(p)]}'" if id(p) in names else f"a parameter of shape {tuple(p.shape)}"
             for p in loose[:_SHOWN]]
    more = f" and {len(loose) - _SHOWN} more" if len(loose) > _SHOWN else ""
    what = (f"the optimizer would update {len(loose)} parameter(s) that no fully_shard unit "
            f"manages ({', '.join(shown)}{more}) from each rank's own gradient, so the ranks' "
            "copies would drift apart")
    return (
        f"fsdp_compose: {what}. Nothing was updated. Call fully_shard on the module that holds "
        "them, usually the root, last: fully_shard(model) after the blocks. If your code reduces "
        "their gradients across ranks itself, call fsdp_compose.mark_reduced_elsewhere(module or "
        "params) on every rank before the first step.")
