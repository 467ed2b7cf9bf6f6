"""Lightning's checkpoint formats for fsdp_compose models: a DCP directory
plus ``meta.pt``, or one file of full tensors rank 0 writes; keyed by
parameter name, so FSDP2's load here and back.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.optim import Optimizer

from ...module_methods.sharded_module import ShardedModule

METADATA_FILENAME = "meta.pt"

TRAINER_OPTIMIZERS = "optimizer_states"

State = dict[str, Any]
Filter = dict[str, Callable[[str, Any], bool]]


def save(path: Path, state: State, model: nn.Module, *, sharded: bool, rank: int,
         filter: Optional[Filter] = None) -> None:
    """Write ``state`` as Lightning does (modules and optimizers as tensors, the
    rest as metadata). On every rank."""
    if not sharded and path.is_dir() and not is_sharded_checkpoint(path):
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
        if is_sharded_checkpoint(path):
            shutil.rmtree(path)
        torch.save({**tensors, **metadata}, path)


def load(path: Path, state: State, model: nn.Module, *, strict: bool = True,
         weights_only: Optional[bool] = None) -> State:
    """Restore ``state`` in place from a sharded or full checkpoint; returns the
    metadata ``state`` did not ask for. On every rank."""
    model_key = next(key for key, obj in state.items() if obj is model)
    optimizers = {key: obj for key, obj in state.items() if isinstance(obj, Optimizer)}
    if is_sharded_checkpoint(path):
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
        for index, (key, opt) in enumerate(optimizers.items()):
            # the Trainer's file lists them, keyed by parameter index
            optim_state = metadata.pop(key) if key in metadata else \
                keyed_by_name(metadata[TRAINER_OPTIMIZERS][index], model)
            set_optimizer_state_dict(model, opt, optim_state_dict=optim_state, options=full)
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
    """``fabric.load_raw(path, model)``: full tensors from one file."""
    if not path.is_file():
        raise ValueError(f"load_raw needs a file of full tensors; {str(path)!r} is not a file.")
    state_dict = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    set_model_state_dict(model, state_dict,
                         options=StateDictOptions(full_state_dict=True, strict=strict))


def is_sharded(module: nn.Module) -> bool:
    return any(isinstance(m, ShardedModule) for m in module.modules())


def sharded_model(objects: Any) -> Optional[nn.Module]:
    models = [obj for obj in objects if isinstance(obj, nn.Module) and is_sharded(obj)]
    if len(models) > 1:
        raise ValueError("fabric.save/load: the state holds several fsdp_compose models; a checkpoint "
                         "holds one model, so save or load each under its own path.")
    return models[0] if models else None


def keyed_by_name(optim_state: State, model: nn.Module) -> State:
    """An optimizer state dict keyed by parameter index rekeyed by name; one
    keyed by name is returned as is."""
    if not optim_state["state"] or not isinstance(next(iter(optim_state["state"])), int):
        if all(isinstance(p, str) for g in optim_state["param_groups"] for p in g["params"]):
            return optim_state
    names = [name for name, _ in model.named_parameters()]
    return {"state": {names[i] if isinstance(i, int) else i: v for i, v in optim_state["state"].items()},
            "param_groups": [{**group, "params": [names[i] if isinstance(i, int) else i
                                                  for i in group["params"]]}
                             for group in optim_state["param_groups"]]}


def _stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_FILENAME).is_file()
