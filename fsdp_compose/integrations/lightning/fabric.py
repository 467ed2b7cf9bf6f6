"""fsdp_compose under Lightning Fabric: Lightning's ``ModelParallelStrategy``
recognises a sharded model only by FSDP2's marks, so ``fabric.save`` and
``fabric.no_backward_sync`` would miss fsdp_compose models;
:class:`ModelParallelStrategy` recognises them too.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Optional, Union

import torch.nn as nn
from lightning.fabric.strategies import ModelParallelStrategy as _LightningModelParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch.optim import Optimizer

from ._checkpoints import Filter, State, is_sharded, load, load_full_model, save, sharded_model
from ._gradient_sync import gradient_sync_off
from ._replicas import check_ranks_synchronise

__all__ = ["ModelParallelStrategy"]


class ModelParallelStrategy(_LightningModelParallelStrategy):
    """Lightning Fabric's ``ModelParallelStrategy`` (same arguments) for models
    ``parallelize_fn`` shards with :func:`fsdp_compose.fully_shard` over
    ``mesh["data_parallel"]``. Without an fsdp_compose model, Lightning's own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backward_sync_control = _GradientSyncControl()

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        check_ranks_synchronise(module)
        return module

    def save_checkpoint(self, path: Union[str, Path], state: State,
                        storage_options: Optional[Any] = None,
                        filter: Optional[Filter] = None) -> None:
        model = sharded_model(state.values())
        if model is None:
            return super().save_checkpoint(path, state, storage_options, filter)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not "
                            "supported: the checkpoint is written by torch.distributed.checkpoint.")
        sharded = self._save_distributed_checkpoint
        if filter is not None and sharded:
            raise NotImplementedError(
                "fabric.save(..., filter=...) with a sharded checkpoint: a filtered sharded checkpoint "
                "cannot be loaded; pass save_distributed_checkpoint=False to the strategy to filter.")
        path = Path(self.broadcast(path))
        save(path, state, model, sharded=sharded, rank=self.global_rank, filter=filter)

    def load_checkpoint(self, path: Union[str, Path],
                        state: Optional[Union[nn.Module, Optimizer, State]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> State:
        if isinstance(state, nn.Module) and is_sharded(state):
            path = Path(self.broadcast(path))
            load_full_model(path, state, strict=strict, weights_only=weights_only)
            return {}
        model = sharded_model(state.values()) if isinstance(state, dict) else None
        if model is None:
            return super().load_checkpoint(path, state, strict, weights_only)
        path = Path(self.broadcast(path))
        return load(path, state, model, strict=strict, weights_only=weights_only)


class _GradientSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled)``: while ``enabled``, the
    units keep their gradients unreduced."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return gradient_sync_off(module) if enabled else contextlib.nullcontext()
