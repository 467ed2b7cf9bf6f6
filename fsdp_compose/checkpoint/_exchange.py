"""Moving values between a flat buffer's layout and dim-0 chunks (one
all-to-all: no rank holds a whole parameter), and between chunks and
``DTensor`` values. Every function is collective over the buffer's group,
with the same ``selected`` on every rank.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence, Union

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from . import _tensor_parallel as tensor_parallel
from ..buffers.layout import FlatLayout, ShardDim
from ..buffers.records import ParamRecord
from ..comm.wire import all_to_all
from ..comm.groups import ShardGroup
from ._chunks import chunk_shape, exchange_plan


Reader = Callable[[int, int], torch.Tensor]
"""``read(start, length)``: elements of this rank's shard, inside one parameter."""


def flat_to_chunks(flat: Union[torch.Tensor, Reader], layout: FlatLayout, group: ShardGroup,
                   selected: Sequence[int], *, dtype: Optional[torch.dtype] = None,
                   home: Optional[torch.device] = None) -> dict[int, torch.Tensor]:
    """This rank's dim-0 chunk of each selected parameter, from ``flat`` or a
    :data:`Reader`, each with storage of its own (a view of one buffer would
    break deepcopy and be copied again by DCP)."""
    if isinstance(flat, torch.Tensor):
        read, dtype, home = functools.partial(flat.narrow, 0), flat.dtype, home or flat.device
    else:
        read, home = flat, home or group.device
    plan = exchange_plan(layout, group.rank, selected)
    pieces = [read(start, length).to(group.device) for start, length in plan.send_intervals]
    send = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=group.device)
    packed = send.new_empty(plan.packed_numel)
    all_to_all(packed, send, list(plan.recv_counts), list(plan.send_counts), group)
    return {c.param_index: packed.narrow(0, c.packed_start, c.numel).view(c.shape)
            .to(home, copy=True) for c in plan.chunks}


def chunks_to_flat(chunks: dict[int, torch.Tensor], layout: FlatLayout, group: ShardGroup,
                   out: torch.Tensor) -> None:
    """Write each ``chunks[i]`` into ``out`` (this rank's shard) where this rank owns it."""
    plan = exchange_plan(layout, group.rank, sorted(chunks))
    pieces = [chunks[c.param_index].reshape(-1).to(group.device, out.dtype)
              for c in plan.chunks]
    packed = torch.cat(pieces) if pieces else out.new_empty(0, device=group.device)
    received = packed.new_empty(sum(plan.send_counts))
    all_to_all(received, packed, list(plan.send_counts), list(plan.recv_counts), group)
    received = received.to(out.device)
    offset = 0
    for start, length in plan.send_intervals:
        out.narrow(0, start, length).copy_(received.narrow(0, offset, length))
        offset += length


def checkpoint_placements(group: ShardGroup) -> tuple[Placement, ...]:
    return _HYBRID_SHARD0 if group.is_hybrid else _SHARD0


_SHARD0: tuple[Placement, ...] = (Shard(0),)  # placements are immutable: made once
_HYBRID_SHARD0: tuple[Placement, ...] = (Replicate(), Shard(0))


def as_checkpoint_value(chunk: torch.Tensor, shape: torch.Size, group: ShardGroup) -> torch.Tensor:
    if len(shape) == 0:
        return chunk
    return DTensor.from_local(chunk, group.mesh, checkpoint_placements(group), run_check=False,
                              shape=shape, stride=_contiguous_strides(shape))


def checkpoint_shape(record: ParamRecord) -> torch.Size:
    return record.shape if record.tp is None else record.tp.shape


def record_value(chunk: torch.Tensor, record: ParamRecord, group: ShardGroup) -> torch.Tensor:
    if record.tp is None:
        return as_checkpoint_value(chunk, record.shape, group)
    return tensor_parallel.checkpoint_value(chunk, record.tp)


def loadable(value: torch.Tensor, record: ParamRecord,
             group: ShardGroup) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """A state-dict value as ``(this rank's dim-0 chunk, None)`` for one exchange, or ``(None,
    whole value)`` to slice locally. Collective over the value's mesh where it must be
    gathered."""
    if record.tp is not None:
        chunk = tensor_parallel.local_chunk(value, record.tp) \
            if isinstance(value, DTensor) else None
        if chunk is not None:
            _check_chunk(chunk, record.shape, group)
            return chunk, None
        return None, tensor_parallel.tp_local_value(value, record.tp)
    if isinstance(value, DTensor):
        chunk = _resharded_chunk(value, group)
        return (chunk, None) if chunk is not None else (None, value.full_tensor())
    return None, value


def _resharded_chunk(value: DTensor, group: ShardGroup) -> Optional[torch.Tensor]:
    if value.device_mesh != group.mesh:
        return None
    placements = checkpoint_placements(group)
    if tuple(value.placements) != placements:
        value = value.redistribute(group.mesh, placements)
    chunk = value.to_local()
    _check_chunk(chunk, value.shape, group)
    return chunk


def _check_chunk(chunk: torch.Tensor, shape: Sequence[int], group: ShardGroup) -> None:
    expected = chunk_shape(tuple(shape), group.world_size, group.rank)
    if tuple(chunk.shape) != expected:
        raise AssertionError(f"[rank {group.rank}] a Shard(0) chunk of shape {tuple(shape)} "
                             f"is {tuple(chunk.shape)} here, expected {expected}")


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def shard_dim(record: ParamRecord) -> Optional[int]:
    return record.placement.dim if isinstance(record.placement, ShardDim) else None


def _shard_dim_placements(group: ShardGroup, dim: int) -> tuple[Placement, ...]:
    return (Replicate(), Shard(dim)) if group.is_hybrid else (Shard(dim),)


def shard_dim_value(local: torch.Tensor, record: ParamRecord, group: ShardGroup) -> torch.Tensor:
    """A ``Shard(d)`` parameter's value: this rank's piece *is* FSDP2's local tensor, placed with
    no exchange."""
    dim = shard_dim(record)
    if record.tp is not None:
        mesh, placements = tensor_parallel.shard_dim_layout(record.tp, dim)
        return DTensor.from_local(local.contiguous().clone(), mesh, placements, run_check=False,
                                  shape=record.tp.shape, stride=record.tp.stride)
    return DTensor.from_local(local.contiguous().clone(), group.mesh,
                              _shard_dim_placements(group, dim), run_check=False,
                              shape=record.shape, stride=_contiguous_strides(record.shape))


def shard_dim_local(value: torch.Tensor, record: ParamRecord, group: ShardGroup) -> torch.Tensor:
    """This rank's ``torch.chunk(value, F, d)[rank]`` of a checkpoint value (redistributed,
    gathered or cut locally)."""
    dim = shard_dim(record)
    if record.tp is not None:
        mesh, placements = tensor_parallel.shard_dim_layout(record.tp, dim)
        if isinstance(value, DTensor) and value.device_mesh == mesh and \
                tuple(value.placements) == placements:
            return value.to_local()
        value = tensor_parallel.tp_local_value(value, record.tp)
    elif isinstance(value, DTensor) and value.device_mesh == group.mesh:
        placements = _shard_dim_placements(group, dim)
        if tuple(value.placements) != placements:
            value = value.redistribute(group.mesh, placements)
        return value.to_local()
    if isinstance(value, DTensor):
        value = value.full_tensor()
    chunks = torch.chunk(value, group.world_size, dim)
    return chunks[group.rank] if group.rank < len(chunks) else value.narrow(dim, 0, 0)


def stored_order(value: torch.Tensor, record: ParamRecord) -> torch.Tensor:
    """A whole value in stored order (``Shard(d)``: dim ``d`` first)."""
    dim = shard_dim(record)
    return value.movedim(dim, 0) if dim else value
