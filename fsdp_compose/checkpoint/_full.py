"""Loading whole weights into a sharded model without a whole copy on every
rank: from one rank's state dict, or from ``safetensors`` files.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from ..buffers.flat_buffer import FlatBuffer
from ._tensor_parallel import refuse_full_load
from ..comm.groups import ShardGroup, backend_device
from ..comm.rendezvous import arrive
from ..runtime.owners import owner_of
from ..runtime.state import units_below
from ..params.meta import allocate_meta
from ._exchange import shard_dim, shard_dim_local, stored_order

StateDict = dict[str, torch.Tensor]


def scatter_full_state_dict(module: nn.Module, state_dict: Optional[StateDict], *, src: int = 0,
                            strict: bool = True) -> None:
    """Load ``src``'s whole state dict into every rank's shards. Collective.

    Args:
        module: a ``fully_shard`` model (meta shards are allocated first).
        state_dict: on ``src``, full tensors under ``module.state_dict()``'s
            keys; ``None`` elsewhere.
        src: the rank that holds ``state_dict``.
        strict: raise on every rank for missing or unexpected keys;
            mis-shaped keys always raise.

    One ``scatter`` per flat buffer; buffers and unmanaged parameters are
    broadcast. Parameters keep their identity."""
    arrive(None, "fsdp_compose.scatter_full_state_dict",
           "Call it on every rank, with the state dict on `src` and None elsewhere.")
    rank = dist.get_rank()
    shapes = [{k: (tuple(v.shape), v.dtype) for k, v in state_dict.items()
               if isinstance(v, torch.Tensor)} if rank == src else None]
    dist.broadcast_object_list(shapes, src=src)
    available = shapes[0]
    entries = _prepare(module, available, strict)
    with torch.no_grad():
        for unit in units_below(module):
            for buffer in unit.buffers:
                _scatter_buffer(buffer, entries.keys_of, state_dict if rank == src else None,
                                available, src)
        for key, tensor in entries.plain.items():
            if key in available or not entries.persistent.get(key, True):
                value = state_dict[key] if rank == src and key in available else tensor
                staged = value.detach().to(backend_device(), tensor.dtype)
                dist.broadcast(staged, src=src)
                tensor.detach().copy_(staged)


def load_safetensors(module: nn.Module, files: Union[str, Path, Iterable[Union[str, Path]]],
                     *, strict: bool = True) -> None:
    """Load ``safetensors`` files (keys as ``module.state_dict()``'s) into a
    sharded model: each rank reads only its slices' rows, plus buffers and
    unmanaged parameters. No communication; non-persistent buffers are left
    alone. ``strict`` as in :func:`scatter_full_state_dict`."""
    from safetensors import safe_open

    paths = [files] if isinstance(files, (str, Path)) else list(files)
    handles = [safe_open(str(p), framework="pt", device="cpu") for p in paths]
    where = {key: h for h in handles for key in h.keys()}
    available = {}
    for key, handle in where.items():
        piece = handle.get_slice(key)
        available[key] = (tuple(piece.get_shape()), None)
    entries = _prepare(module, available, strict)
    with torch.no_grad():
        for unit in units_below(module):
            for buffer in unit.buffers:
                for index, (record, s) in enumerate(zip(buffer.records, buffer.local_slices())):
                    key = _first_present(entries.keys_of[id(record.param)], available)
                    if key is None or s.length == 0:
                        continue
                    if shard_dim(record) is not None:  # a column block: read whole
                        buffer.local_view(buffer.sharded, index).copy_(shard_dim_local(
                            where[key].get_tensor(key), record, buffer.group))
                        continue
                    buffer.sharded.narrow(0, s.shard_start, s.length).copy_(
                        _read_flat_range(where[key], key, record.shape, s.param_start, s.length))
        for key, tensor in entries.plain.items():
            if key in where:
                tensor.detach().copy_(where[key].get_tensor(key))


class _Entries:

    def __init__(self) -> None:
        self.keys_of: dict[int, list[str]] = {}
        self.shape_of: dict[str, tuple[int, ...]] = {}
        self.plain: dict[str, torch.Tensor] = {}
        self.persistent: dict[str, bool] = {}


def _prepare(module: nn.Module, available: dict, strict: bool) -> "_Entries":
    """Allocate meta shards, then check the checkpoint's keys and shapes."""
    allocate_meta(module)
    entries = _entries(module)
    _check_keys(entries, available, strict)
    return entries


def _entries(module: nn.Module) -> _Entries:
    entries = _Entries()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        prefix = f"{prefix}." if prefix else ""
        for name, param in sub._parameters.items():
            if param is None:
                continue
            key = prefix + name
            owner = owner_of(param)
            if owner is None:
                entries.plain[key] = param
                entries.shape_of[key] = tuple(param.shape)
            else:
                record = owner.buffer.records[owner.index]
                if record.tp is not None:  # the same on every rank: raised everywhere
                    refuse_full_load(record.fqn)
                entries.keys_of.setdefault(id(param), []).append(key)
                entries.shape_of[key] = tuple(record.shape)
        for name, buf in sub._buffers.items():
            if buf is not None:
                key = prefix + name
                entries.plain[key] = buf
                entries.persistent[key] = name not in sub._non_persistent_buffers_set
                if entries.persistent[key]:
                    entries.shape_of[key] = tuple(buf.shape)
    return entries


def _check_keys(entries: _Entries, available: dict, strict: bool) -> None:
    """Raise on every rank for mis-shaped keys, and missing or unexpected ones
    when ``strict``."""
    errors = [f"size mismatch for {key}: copying a param with shape {available[key][0]} from "
              f"checkpoint, the shape in current model is {torch.Size(shape)}."
              for key, shape in entries.shape_of.items()
              if key in available and tuple(available[key][0]) != shape]
    if strict:
        missing = [k for k in entries.shape_of if k not in available]
        unexpected = [k for k in available if k not in entries.shape_of]
        if missing:
            errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing))
        if unexpected:
            errors.append("Unexpected key(s) in state_dict: "
                          + ", ".join(f'"{k}"' for k in unexpected))
    if errors:
        raise RuntimeError("Error(s) in loading state_dict:\n\t" + "\n\t".join(errors))


def _scatter_buffer(buffer: FlatBuffer, keys_of: dict[int, list[str]],
                    state_dict: Optional[StateDict], available: dict, src: int) -> None:
    group = buffer.group
    present = [_first_present(keys_of[id(r.param)], available) for r in buffer.records]
    if not any(present):
        return
    device = group.device
    shard = torch.empty(buffer.layout.shard_numel, dtype=buffer.dtype, device=device)
    chunks = None
    if state_dict is not None:
        full = torch.zeros(buffer.layout.padded_numel, dtype=buffer.dtype, device=device)
        for segment in buffer.layout.segments():
            key = present[segment.param_index] if segment.param_index >= 0 else None
            if key is not None:
                stored = stored_order(state_dict[key], buffer.records[segment.param_index])
                full.narrow(0, segment.start, segment.length).copy_(
                    stored.reshape(-1).narrow(0, segment.param_start, segment.length))
        chunks = list(full.chunk(group.world_size))
    _scatter_chunks(shard, chunks, group, src)
    for s, key in zip(buffer.local_slices(), present):
        if key is not None:
            buffer.sharded.narrow(0, s.shard_start, s.length).copy_(
                shard.narrow(0, s.shard_start, s.length))


def _scatter_chunks(shard: torch.Tensor, chunks: Optional[list[torch.Tensor]],
                    group: ShardGroup, src: int) -> None:
    """``src``'s ``chunks`` to its shard group, then (hybrid) across the replicas."""
    replicate = group.replicate_process_group
    replica_row = None
    if replicate is not None:
        ranks = group.mesh.mesh
        where = (ranks == src).nonzero()
        if len(where) == 0:
            raise ValueError(f"src rank {src} is not in the mesh {ranks.tolist()}")
        replica_row = ranks[int(where[0][0])]
    if replica_row is None or dist.get_rank() in replica_row.tolist():
        if group.world_size == 1:
            shard.copy_(chunks[0])
        else:
            dist.scatter(shard, chunks, src=src, group=group.process_group)
    if replica_row is not None and group.replicate_size > 1:
        dist.broadcast(shard, src=int(replica_row[group.rank]), group=replicate)


def _read_flat_range(handle, key: str, shape: torch.Size, start: int, length: int) -> torch.Tensor:
    """Elements of the flattened ``key``, reading only the rows that hold them."""
    if len(shape) == 0:
        return handle.get_tensor(key).reshape(-1)[start:start + length]
    row = math.prod(shape[1:])
    first, last = start // row, -(-(start + length) // row)
    rows = handle.get_slice(key)[first:last]
    return rows.reshape(-1)[start - first * row:start - first * row + length]


def _first_present(keys: list[str], available: dict) -> Optional[str]:
    return next((k for k in keys if k in available), None)
