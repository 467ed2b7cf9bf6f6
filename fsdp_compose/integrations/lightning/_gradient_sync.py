"""Gradient synchronisation off for a while, on every sharded unit of a
model: what Lightning's gradient-accumulation contexts ask of a strategy."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

from ...module_methods.sharded_module import ShardedModule


@contextlib.contextmanager
def gradient_sync_off(module: nn.Module) -> Iterator[None]:
    """Every unit of ``module`` (ours or FSDP2's) keeps its gradients
    unreduced inside (the next backward after reduces the sum)."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in module.modules() if isinstance(m, (ShardedModule, FSDPModule))]
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)
