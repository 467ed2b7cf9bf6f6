"""Refuse the forgotten root: parameters the optimizer would update from
each rank's own gradient.

``fully_shard`` on every block but not on the root leaves the embeddings,
final norm and head as plain parameters: each rank's backward gives them
its own local gradient, the optimizer steps on it, and the replicas drift
apart silently (torch FSDP2 is silent too). At an optimizer's first step
with gradients, before it updates anything, if it holds parameters of
``fully_shard`` units, every parameter with a gradient that

* no unit manages,
* is not a ``DTensor`` (tensor parallelism, ``replicate``'s DTensor form),
* no DDP (``DistributedDataParallel``) or ``replicate`` module holds, and
* was not passed to :func:`mark_reduced_elsewhere` (nor in
  ``fully_shard``'s ``ignored_params``)

is named in a ``RuntimeError``. The look is local, with no collective: a
step pre-hook cannot know that every rank steps the same optimizer over
the same parameters (Muon over owned matrices gives each rank its own, and
a rank whose optimizer holds nothing with a gradient looks later), so a
collective here could pair with nothing on another rank. Models and
optimizers built alike on every rank (the SPMD script) decide alike, so
every rank raises; where they differ, the rank that raises alone ends the
job (torchrun stops the others). Cost: one look per optimizer, at its first
step with gradients; a walk up from the units to the user's model
(``_naming.py``) only when such parameters exist.
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
"""The parameters marked by the user, by id, held strongly while anything
else holds them: a weak reference would stop ``torch.utils.swap_tensors``
(which keeps a parameter's identity through ``to_empty``), and an id alone
could be reused by a later model's parameter, which the check would then
skip. :func:`_forget_dropped` lets go of those only this dict still holds."""
_SHOWN = 8  # parameters named in the message


def mark_reduced_elsewhere(module_or_params: Union[nn.Module, Iterable[torch.Tensor]]) -> None:
    """Tell fsdp_compose that these parameters (a module's, or the given
    ones), which no ``fully_shard`` unit manages, have their gradients
    reduced across ranks by other code (by hand, or an API it does not
    recognise), so the optimizer's first step does not refuse to update
    them. Call it on every rank, before the first ``optimizer.step()``."""
    params = module_or_params.parameters() if isinstance(module_or_params, nn.Module) \
        else module_or_params
    _forget_dropped()
    for param in params:
        _reduced_elsewhere[id(param)] = param


def _forget_dropped() -> None:
    """Drop the marks of parameters nothing but this module holds any more
    (a dropped model's), so their ids cannot be taken for a new one's."""
    for key in list(_reduced_elsewhere):
        if sys.getrefcount(_reduced_elsewhere[key]) <= 2:  # the dict and this call's argument
            del _reduced_elsewhere[key]


def install_unmanaged_check() -> None:
    """Install the step pre-hook (once per process)."""
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
    """ids of the parameters a DDP or a ``replicate``-annotated module holds."""
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
