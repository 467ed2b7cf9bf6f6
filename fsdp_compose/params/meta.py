"""Allocating a meta-device model: units get their shards only, the rest
whole tensors, uninitialised."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..runtime.state import units_below
from ..runtime.tensors import swapping_params_on_conversion


def allocate_meta(module: nn.Module, device: Optional[torch.device] = None) -> None:
    """``module.to_empty(device=...)`` if it holds meta tensors: units allocate
    only their shards, the rest goes to ``device`` (default: the units'
    compute device; CPU without units)."""
    if not any(t.is_meta for t in module.parameters()) and \
            not any(t.is_meta for t in module.buffers()):
        return
    if device is None:
        units = units_below(module)
        device = units[0].group.device if units else torch.device("cpu")
    # swapping keeps unannotated Parameters' identity (no `.data =` on meta)
    with swapping_params_on_conversion():
        module.to_empty(device=device)
