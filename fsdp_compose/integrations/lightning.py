"""fsdp_compose under Lightning Fabric: the strategy to pass to ``Fabric``.

Lightning's ``ModelParallelStrategy`` runs the user's ``parallelize_fn``
(where FSDP2's recipe calls torch's ``fully_shard``) and then recognises the
sharded model by what FSDP2 leaves on it: ``DTensor`` parameters to save and
load, ``FSDPModule`` to skip gradient synchronisation. fsdp_compose keeps the
original parameters as plain tensors, so with Lightning's own strategy
``fabric.save`` finds no model and ``fabric.no_backward_sync`` does nothing.

:class:`ModelParallelStrategy` is Lightning's strategy with those three
places made to recognise fsdp_compose models (any module of the model is a
:class:`~fsdp_compose.ShardedModule`); everything else, FSDP2 models
included, is Lightning's. The checkpoints are Lightning's formats: a
directory of torch.distributed.checkpoint shards plus ``meta.pt`` (the
default), or one file holding full tensors
(``save_distributed_checkpoint=False``). Tensors go through torch's
``get_model_state_dict`` / ``get_optimizer_state_dict``, keyed by parameter
name, so such a checkpoint written by FSDP2 under Lightning resumes under
fsdp_compose and the other way round (the shards are re-cut on load).

Gradient clipping needs nothing here: Lightning calls
``torch.nn.utils.clip_grad_norm_``, which fsdp_compose routes to the norm
over all ranks (``route_torch_grad_norms``).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from lightning.fabric.strategies import ModelParallelStrategy as _LightningModelParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.optim import Optimizer

from ..sharded_module import ShardedModule

__all__ = ["ModelParallelStrategy"]

METADATA_FILENAME = "meta.pt"
"""What Lightning names the file of a sharded checkpoint's non-tensor state."""

State = dict[str, Any]
Filter = dict[str, Callable[[str, Any], bool]]


class ModelParallelStrategy(_LightningModelParallelStrategy):
    """``lightning.fabric.strategies.ModelParallelStrategy`` for models that
    ``parallelize_fn`` shards with :func:`fsdp_compose.fully_shard`. Takes
    the same arguments; the device mesh Lightning builds has the dims
    ``"data_parallel"`` and ``"tensor_parallel"`` (shard over
    ``mesh["data_parallel"]``; note that Lightning's default sizes put every
    device on ``"tensor_parallel"``).

    Invariant: for a state without an fsdp_compose model every method is
    Lightning's own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backward_sync_control = _GradientSyncControl()

    def save_checkpoint(self, path: Union[str, Path], state: State,
                        storage_options: Optional[Any] = None,
                        filter: Optional[Filter] = None) -> None:
        model = _sharded_model(state.values())
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
        if isinstance(state, nn.Module) and _is_sharded(state):
            path = Path(self.broadcast(path))
            load_full_model(path, state, strict=strict, weights_only=weights_only)
            return {}
        model = _sharded_model(state.values()) if isinstance(state, dict) else None
        if model is None:
            return super().load_checkpoint(path, state, strict, weights_only)
        path = Path(self.broadcast(path))
        return load(path, state, model, strict=strict, weights_only=weights_only)


def save(path: Path, state: State, model: nn.Module, *, sharded: bool, rank: int,
         filter: Optional[Filter] = None) -> None:
    """Write ``state`` as Lightning does: modules and optimizers as tensors
    (sharded: a torch.distributed.checkpoint directory; else full tensors in
    one file that rank 0 writes), everything else as metadata (``state_dict()``
    of what has one). Called on every rank."""
    if not sharded and path.is_dir() and not _is_sharded_checkpoint(path):
        raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
    options = StateDictOptions(full_state_dict=not sharded, cpu_offload=True)
    tensors: State = {}
    metadata: State = {}
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            if obj is not model:
                raise ValueError("fabric.save: one model per checkpoint (the state holds two); save "
                                 "each model to its own path.")
            value, target = get_model_state_dict(obj, options=options), tensors
        elif isinstance(obj, Optimizer):
            value, target = get_optimizer_state_dict(model, obj, options=options), tensors
        else:
            value, target = (obj.state_dict() if _stateful(obj) else obj), metadata
        if filter is not None and key in filter:
            value = {name: v for name, v in value.items() if filter[key](name, v)}
        target[key] = value
    if sharded:
        if path.is_file() and rank == 0:
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        dcp.save(tensors, checkpoint_id=path)
        if rank == 0:
            torch.save(metadata, path / METADATA_FILENAME)
        return
    if rank == 0:
        if _is_sharded_checkpoint(path):
            shutil.rmtree(path)
        torch.save({**tensors, **metadata}, path)


def load(path: Path, state: State, model: nn.Module, *, strict: bool = True,
         weights_only: Optional[bool] = None) -> State:
    """Restore ``state`` in place from a checkpoint :func:`save` (or
    Lightning) wrote, sharded or full; returns the metadata that ``state``
    did not ask for. Called on every rank."""
    model_key = next(key for key, obj in state.items() if obj is model)
    optimizers = {key: obj for key, obj in state.items() if isinstance(obj, Optimizer)}
    if _is_sharded_checkpoint(path):
        tensors = {model_key: get_model_state_dict(model)}
        tensors.update({key: get_optimizer_state_dict(model, opt) for key, opt in optimizers.items()})
        dcp.load(tensors, checkpoint_id=path)
        set_model_state_dict(model, tensors[model_key], options=StateDictOptions(strict=strict))
        for key, opt in optimizers.items():
            set_optimizer_state_dict(model, opt, optim_state_dict=tensors[key])
        metadata = torch.load(path / METADATA_FILENAME, weights_only=weights_only)
    elif path.is_file():
        metadata = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        full = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(model, metadata.pop(model_key), options=full)
        for key, opt in optimizers.items():
            set_optimizer_state_dict(model, opt, optim_state_dict=metadata.pop(key), options=full)
    else:
        raise ValueError(f"{str(path)!r} is neither a sharded checkpoint (a directory with "
                         f"{METADATA_FILENAME}) nor a checkpoint file.")
    wanted = [key for key in state if key != model_key and key not in optimizers]
    missing = [key for key in wanted if key not in metadata]
    if strict and missing:
        raise KeyError(f"The requested state contains keys {missing} that are not in the checkpoint "
                       f"{str(path)!r}; pass strict=False to load the rest.")
    for key in wanted:
        if key not in metadata:
            continue
        value = metadata.pop(key)
        if _stateful(state[key]):
            state[key].load_state_dict(value)
        else:
            state[key] = value
    return metadata


def load_full_model(path: Path, model: nn.Module, *, strict: bool = True,
                    weights_only: Optional[bool] = None) -> None:
    """``fabric.load_raw(path, model)``: full tensors from one file (every
    rank reads it, memory-mapped) into the sharded model."""
    if not path.is_file():
        raise ValueError(f"load_raw needs a file of full tensors; {str(path)!r} is not a file.")
    state_dict = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    set_model_state_dict(model, state_dict,
                         options=StateDictOptions(full_state_dict=True, strict=strict))


class _GradientSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled)``: while ``enabled``, every
    sharded unit of ``model`` (fsdp_compose's or FSDP2's) keeps its
    gradients unreduced; on exit they synchronise again (the backward after
    the context reduces the sum)."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return _gradient_sync_off(module) if enabled else contextlib.nullcontext()


@contextlib.contextmanager
def _gradient_sync_off(module: nn.Module) -> Iterator[None]:
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in module.modules() if isinstance(m, (ShardedModule, FSDPModule))]
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)


def _is_sharded(module: nn.Module) -> bool:
    return any(isinstance(m, ShardedModule) for m in module.modules())


def _sharded_model(objects: Any) -> Optional[nn.Module]:
    """The fsdp_compose model among ``objects`` (``None``: none is)."""
    models = [obj for obj in objects if isinstance(obj, nn.Module) and _is_sharded(obj)]
    if len(models) > 1:
        raise ValueError("fabric.save/load: the state holds several fsdp_compose models; a checkpoint "
                         "holds one model, so save or load each under its own path.")
    return models[0] if models else None


def _stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_FILENAME).is_file()
