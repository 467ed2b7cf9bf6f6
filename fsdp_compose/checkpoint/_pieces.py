"""A rank's piece of one parameter or per-element state as a value DCP writes
and reads in place: it shares the flat shard's memory and names its boxes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, Iterator, Optional, Sequence

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
    """This rank's piece of one parameter's values, as DCP boxes over ``local``;
    a box's view is made only when DCP asks (:meth:`view_at`).

    Attributes:
        shape: the parameter's global shape.
        dtype: the values' dtype.
        local: the tensor holding the piece; ``None``: no state here.
        boxes: ``(box, where)`` in increasing order: the box's first element in
            ``local`` flattened, or ``None`` where the box is ``local`` itself.

    Pickling raises: DCP's default planners would store it as bytes."""

    __slots__ = ("shape", "dtype", "local", "boxes")

    def __init__(self, shape: torch.Size, dtype: torch.dtype, local: Optional[torch.Tensor],
                 boxes: Sequence[tuple[Box, Optional[int]]]) -> None:
        self.shape: torch.Size = torch.Size(shape)
        self.dtype: torch.dtype = dtype
        self.local: Optional[torch.Tensor] = local
        self.boxes: Sequence[tuple[Box, Optional[int]]] = boxes

    @classmethod
    def of(cls, buffer: FlatBuffer, index: int, local: Optional[torch.Tensor],
           *, dtype: Optional[torch.dtype] = None, lead: bool = False) -> "ShardPieces":
        """The pieces of parameter ``index`` held in ``local``. ``lead``: this rank
        writes the empty box of a parameter with no elements, so its key reaches
        the metadata."""
        record = buffer.records[index]
        shape = torch.Size(record.shape)
        if local is None:
            return cls(shape, dtype, None, [])
        s = buffer.local_slices()[index]
        if shape.numel() == 0:
            return cls(shape, local.dtype, local,
                       [(Box((0,) * len(shape), tuple(shape), 0), 0)] if lead else [])
        dim = shard_dim(record)
        if dim is not None:  # Shard(d): one box in the parameter's own dim order
            lo = s.param_start // buffer.layout.row_numel(index) if s.length else 0
            rows = local.shape[dim] if s.length else 0
            return cls(shape, local.dtype, local,
                       [(dim_box(shape, dim, lo, lo + rows), None)] if rows else [])
        if s.length and not local.is_contiguous():
            raise AssertionError(f"[rank {buffer.group.rank}] the piece of '{record.fqn}' is not "
                                 "contiguous; it cannot be cut into box views")
        return cls(shape, local.dtype, local, _boxes_at(tuple(shape), s.param_start, s.length))

    def size(self) -> torch.Size:
        return self.shape

    def write_items(self, fqn: str) -> list[WriteItem]:
        """One write item per box (not ``__create_write_items__``: DCP's default
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
        return ShardPieces(self.shape, self.dtype, local, self.boxes)

    def views(self) -> Iterator[tuple[Box, torch.Tensor]]:
        """``(box, view of local in the box's shape)``, in increasing order."""
        for box, where in self.boxes:
            yield box, self._view(box, where)

    def view_at(self, offsets: tuple[int, ...]) -> torch.Tensor:
        """The box at ``offsets`` as a view of ``local``, of its own storage on the
        CPU."""
        offsets = tuple(offsets)
        for box, where in self.boxes:
            if box.offsets == offsets:
                return exact_storage(self._view(box, where))
        raise KeyError(f"no box of {self!r} starts at {offsets}")

    def _view(self, box: Box, where: Optional[int]) -> torch.Tensor:
        if where is None:  # Shard(d): the piece itself
            return self.local
        return self.local.reshape(-1).narrow(0, where, box.numel).view(box.sizes)

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


@functools.lru_cache(maxsize=4096)
def _boxes_at(shape: tuple[int, ...], start: int, length: int) -> tuple[tuple[Box, int], ...]:
    """:func:`range_boxes` of elements ``[start, start + length)``, each with
    its first element's offset in the piece."""
    return tuple((box, box.flat_start - start)
                 for box in range_boxes(shape, start, start + length))


def exact_storage(view: torch.Tensor) -> torch.Tensor:
    """``view`` (contiguous, CPU) with a storage of exactly its bytes, through
    DLPack: DCP's writer clones every CPU tensor whose storage is larger."""
    if view.device.type != "cpu" or not view.is_contiguous() or \
            view.untyped_storage().nbytes() == view.nbytes:
        return view
    try:
        return torch.from_dlpack(view.detach())
    except (RuntimeError, BufferError, TypeError):  # a dtype DLPack cannot carry
        return view

