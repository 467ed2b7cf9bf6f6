"""Allocating a meta-device model: annotated units get their shards only,
everything else its whole tensors, all uninitialised (``materialize`` and
the full-state-dict load start here)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..runtime.state import units_below
from ..runtime.tensors import swapping_params_on_conversion


def allocate_meta(module: nn.Module, device: Optional[torch.device] = None) -> None:
    """``module.to_empty(device=...)`` if it holds meta tensors: annotated
    units allocate only their shards (where ``fully_shard`` keeps them),
    the rest goes to ``device`` (default: the units' compute device; CPU
    without units). Values are uninitialised."""
    if not any(t.is_meta for t in module.parameters()) and \
            not any(t.is_meta for t in module.buffers()):
        return
    if device is None:
        units = units_below(module)
        device = units[0].group.device if units else torch.device("cpu")
    # A meta Parameter cannot take `.data = <real tensor>`: without swapping,
    # torch would register new Parameter objects for unannotated parameters.
    with swapping_params_on_conversion():
        module.to_empty(device=device)
