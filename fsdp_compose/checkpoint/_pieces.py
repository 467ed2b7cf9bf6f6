"""A rank's piece of one parameter or per-element state as a value DCP writes and reads in place
(:class:`ShardPieces`, inside :func:`flat_values`): it shares the flat shard's memory and
names its boxes (``_boxes.py``); the flat planners hand DCP the box views.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator, Optional

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..buffers.flat_buffer import FlatBuffer
from ._boxes import Box, dim_box, range_boxes
from ._exchange import shard_dim

_FLAT = contextvars.ContextVar("fsdp_compose_flat_state_dict", default=False)


@contextlib.contextmanager
def flat_values() -> Iterator[None]:
    """Inside: ``state_dict()`` returns :class:`ShardPieces` for every value but tensor-parallel
    ones."""
    token = _FLAT.set(True)
    try:
        yield
    finally:
        _FLAT.reset(token)


def flat_values_requested() -> bool:
    return _FLAT.get()


def has_pieces(buffer: FlatBuffer, index: int) -> bool:
    return buffer.records[index].tp is None


class ShardPieces:
    """This rank's piece of one parameter's values, as DCP boxes over views of ``local``.

    Attributes:
        shape: the parameter's global shape.
        dtype: the values' dtype.
        local: the tensor holding the piece; ``None``: no state here.
        boxes: ``(box, view of local)``, in increasing order.

    Pickling raises: DCP's default planners would store it as bytes."""

    __slots__ = ("shape", "dtype", "local", "boxes", "_at")

    def __init__(self, shape: torch.Size, dtype: torch.dtype, local: Optional[torch.Tensor],
                 boxes: list[tuple[Box, torch.Tensor]]) -> None:
        self.shape: torch.Size = torch.Size(shape)
        self.dtype: torch.dtype = dtype
        self.local: Optional[torch.Tensor] = local
        self.boxes: list[tuple[Box, torch.Tensor]] = boxes
        self._at: dict[tuple[int, ...], torch.Tensor] = {b.offsets: t for b, t in boxes}

    @classmethod
    def of(cls, buffer: FlatBuffer, index: int, local: Optional[torch.Tensor],
           *, dtype: Optional[torch.dtype] = None, lead: bool = False) -> "ShardPieces":
        """The pieces of parameter ``index`` held in ``local`` (``None``: none here). ``lead``:
        this rank writes the empty box of a parameter with no elements, so its key reaches the
        metadata."""
        record = buffer.records[index]
        shape = torch.Size(record.shape)
        if local is None:
            return cls(shape, dtype, None, [])
        s = buffer.local_slices()[index]
        if shape.numel() == 0:
            return cls(shape, local.dtype, local, [(Box((0,) * len(shape), tuple(shape), 0),
                                                    local.reshape(-1)[:0].view(shape))] if lead else [])
        dim = shard_dim(record)
        if dim is not None:  # Shard(d): one box in the parameter's own dim order
            lo = s.param_start // buffer.layout.row_numel(index) if s.length else 0
            rows = local.shape[dim] if s.length else 0
            return cls(shape, local.dtype, local,
                       [(dim_box(shape, dim, lo, lo + rows), local)] if rows else [])
        if s.length and not local.is_contiguous():
            raise AssertionError(f"[rank {buffer.group.rank}] the piece of '{record.fqn}' is not "
                                 "contiguous; it cannot be cut into box views")
        flat = local.reshape(-1)
        return cls(shape, local.dtype, local, [
            (box, flat.narrow(0, box.flat_start - s.param_start, box.numel).view(box.sizes))
            for box in range_boxes(shape, s.param_start, s.param_start + s.length)])

    def size(self) -> torch.Size:
        return self.shape

    def write_items(self, fqn: str) -> list[WriteItem]:
        """One write item per box (not the ``__create_write_items__`` protocol: DCP's default
        planner must reach ``__reduce__``'s message)."""
        properties = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(box.offsets)),
                          type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(box.offsets),
                                                         sizes=torch.Size(box.sizes)),
                              properties=properties, size=self.shape))
                for box, _ in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))
                for box, _ in self.boxes]

    def staged(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> "ShardPieces":
        if self.local is None:
            return ShardPieces(self.shape, self.dtype, None, [])
        local = copy(self.local)
        if local.stride() != self.local.stride():
            raise AssertionError(f"a staged copy has strides {local.stride()}, "
                                 f"not {self.local.stride()}")
        base = self.local.storage_offset()
        return ShardPieces(self.shape, self.dtype, local, [
            (box, local.as_strided(t.shape, t.stride(),
                                   local.storage_offset() + t.storage_offset() - base))
            for box, t in self.boxes])

    def view_at(self, offsets: tuple[int, ...]) -> torch.Tensor:
        return exact_storage(self._at[tuple(offsets)])

    def __reduce__(self):
        raise TypeError(
            "a state dict of fsdp_compose.checkpoint.flat_state_dict() holds views of the flat "
            "shards that only fsdp_compose's planners can write and read: pass "
            "planner=FlatSavePlanner() to dcp.save / dcp.async_save and "
            "planner=FlatLoadPlanner() to dcp.load (fsdp_compose.checkpoint), or use "
            "CheckpointStore, which does.")

    def __repr__(self) -> str:
        return (f"ShardPieces(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"boxes={[(b.offsets, b.sizes) for b, _ in self.boxes]})")


def exact_storage(view: torch.Tensor) -> torch.Tensor:
    """``view`` (contiguous, CPU) with a storage of exactly its bytes, through DLPack: DCP's file
    writer clones every CPU tensor whose storage is larger."""
    if view.device.type != "cpu" or not view.is_contiguous() or \
            view.untyped_storage().nbytes() == view.nbytes:
        return view
    try:
        return torch.from_dlpack(view.detach())
    except (RuntimeError, BufferError, TypeError):  # a dtype DLPack cannot carry
        return view

