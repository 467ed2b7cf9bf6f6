"""Warn once about parameters the optimizer updates from each rank's own
gradient: the forgotten root.

``fully_shard`` on every block but not on the root leaves the embeddings,
final norm and head as plain parameters: each rank's backward gives them
its own local gradient, the optimizer steps on it, and the replicas drift
apart silently (torch FSDP2 is silent too). At an optimizer's first step
with gradients, if it also holds parameters of ``fully_shard`` units, every
parameter with a gradient that no unit manages, that is not a ``DTensor``
(tensor parallelism, ``replicate``'s FSDP-based form) and that no DDP
(``DistributedDataParallel``, ``replicate``) reduces is named in one
warning on rank 0. :func:`mark_reduced_elsewhere` opts parameters out for
users who reduce them by hand. Cost: one look per optimizer, at its first
step with gradients; a search of live objects only when such parameters
exist (to name them and find DDP instances).
"""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..runtime.owners import owner_of

_installed: list[object] = []
_looked_at: "weakref.WeakKeyDictionary[Optimizer, bool]" = weakref.WeakKeyDictionary()
_reduced_elsewhere: set[int] = set()
"""ids of parameters marked by the user (not weak references to them, which
would stop ``torch.utils.swap_tensors``; the parameters outlive the model's
training, and an id reused by a later tensor only silences this warning)."""
_SHOWN = 8  # parameters named in the warning


def mark_reduced_elsewhere(params: Iterable[torch.Tensor]) -> None:
    """Tell fsdp_compose that ``params`` (not managed by any ``fully_shard``
    unit) have their gradients reduced across ranks by other code (by hand,
    or an API it does not recognise), so the optimizer's first step does not
    warn that they are updated from each rank's own gradient."""
    for param in params:
        _reduced_elsewhere.add(id(param))


def install_unmanaged_warning() -> None:
    """Install the step pre-hook (once per process)."""
    if not _installed:
        _installed.append(register_optimizer_step_pre_hook(_look_once))


def _look_once(optimizer: Optimizer, args: object, kwargs: object) -> None:
    if optimizer in _looked_at:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(p.grad is not None for p in params):
        return  # no backward yet: look at a later step
    _looked_at[optimizer] = True
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_rank() != 0:
        return
    if not any(owner_of(p) is not None for p in params):
        return  # not the optimizer of a fully_shard model
    loose = [p for p in params if p.grad is not None and owner_of(p) is None
             and not isinstance(p, DTensor) and id(p) not in _reduced_elsewhere]
    if not loose:
        return
    names, by_ddp = _names_and_ddp(loose)
    loose = [p for p in loose if id(p) not in by_ddp]
    if not loose:
        return
    shown = [names.get(id(p), f"a parameter of shape {tuple(p.shape)}") for p in loose[:_SHOWN]]
    more = f" and {len(loose) - _SHOWN} more" if len(loose) > _SHOWN else ""
    warnings.warn(
        f"fsdp_compose: the optimizer updates {len(loose)} parameter(s) that no fully_shard unit "
        f"manages ({', '.join(shown)}{more}): they are updated on each rank from its own "
        "gradient, so the ranks' copies drift apart. Call fully_shard on the module that holds "
        "them, usually the root (fully_shard(model) after the blocks). If your code reduces "
        "their gradients itself, call fsdp_compose.mark_reduced_elsewhere(params) to silence "
        "this.", stacklevel=3)


def _names_and_ddp(loose: list[torch.Tensor]) -> tuple[dict[int, str], set[int]]:
    """The longest FQN of each parameter in ``loose`` among live modules
    (the outermost module's), and the ids of those a live DDP reduces."""
    wanted = {id(p) for p in loose}
    names: dict[int, str] = {}
    by_ddp: set[int] = set()
    for obj in gc.get_objects():
        if isinstance(obj, DistributedDataParallel):
            by_ddp.update(id(p) for p in obj.module.parameters() if id(p) in wanted)
        elif isinstance(obj, nn.Module):
            for name, param in obj.named_parameters(remove_duplicate=False):
                if id(param) in wanted and len(name) > len(names.get(id(param), "")):
                    names[id(param)] = name
    return {key: f"'{name}'" for key, name in names.items()}, by_ddp
