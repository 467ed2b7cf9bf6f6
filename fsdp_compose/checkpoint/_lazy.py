"""State-dict values in torch FSDP2's layout converted only when used.

[Note: lazy checkpoint values]
``state_dict()`` returns, for each parameter and per-element optimizer
state of the flat layouts, a ``DTensor`` whose local tensor is a
:class:`LazyChunk` holding no memory. Through DTensor's DCP protocol
(``__create_write_items__`` and kin) DCP gets the boxes of this rank's piece
of the flat shard: ``dcp.save`` writes the shard as it lies and ``dcp.load``
reads into it. Any other use *materialises* the chunk once, collectively:
ranks must use the values in the same order, as with ``full_tensor()``.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.tensor import DTensor

from .._torch_private import (DTensorSpec, TensorMeta, compute_local_shape_and_global_offset,
                              create_write_items_for_dtensor, dtensor_spec, local_tensor,
                              make_wrapper_subclass, pytree)
from ..buffers.flat_buffer import FlatBuffer
from ..comm.groups import ShardGroup
from ..comm.rendezvous import arrive
from ._exchange import shard_dim
from ._pieces import ShardPieces, has_pieces

SAVE_ADVICE = (
    "To write one file from rank 0, gather the state dict on every rank and save on rank 0: "
    "`sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, "
    "cpu_offload=True))` (from torch.distributed.checkpoint.state_dict), then "
    "`if rank == 0: torch.save(sd, f)`; for sharded saves, call "
    "`torch.distributed.checkpoint.save({'model': model.state_dict()}, checkpoint_id=path)` "
    "on every rank (or use CheckpointStore).")
_FIX = ("Values of fsdp_compose's state dicts are converted to FSDP2's layout when first used, "
        "collectively: use them (full_tensor(), tensor operations, deepcopy, pickling by "
        "torch.save) on every rank in the same order. " + SAVE_ADVICE)


class LazyChunk(torch.Tensor):
    """This rank's chunk of one value, computed when first used.

    Attributes:
        pieces: this rank's piece in the flat layout, as boxes.
        source: the tensor the piece lives in."""

    pieces: ShardPieces
    source: torch.Tensor
    _convert: Callable[[], torch.Tensor]
    _value: Optional[torch.Tensor]
    _what: str
    _group: ShardGroup
    _offsets: tuple[int, ...]

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                pieces: ShardPieces, source: torch.Tensor, convert: Callable[[], torch.Tensor],
                group: ShardGroup, what: str, offsets: tuple[int, ...]) -> "LazyChunk":
        r = make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        r.pieces, r.source, r._convert, r._value = pieces, source, convert, None
        r._group, r._what, r._offsets = group, what, offsets
        return r

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    @property
    def materialized(self) -> bool:
        return self._value is not None

    def materialize(self) -> torch.Tensor:
        """The chunk's values (collective the first time)."""
        if self._value is None:
            arrive(self._group.process_group, f"state_dict() value ({self._what}) first used",
                   _FIX)
            self._value = self._convert()
        return self._value

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def real(x: Any) -> Any:
            return x.materialize() if isinstance(x, LazyChunk) else x
        return func(*pytree.tree_map(real, args), **pytree.tree_map(real, kwargs or {}))

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return self.materialize().clone()

    def __reduce_ex__(self, protocol: int):
        return self.materialize().__reduce_ex__(protocol)

    def __repr__(self) -> str:
        state = "materialized" if self.materialized else "in the flat shard"
        return f"LazyChunk({tuple(self.shape)}, {self.dtype}, {state})"

    def staged(self, value: DTensor, copy: Callable[[torch.Tensor], torch.Tensor]) -> DTensor:
        """``value`` over a copy of this rank's pieces, for an async save."""
        pieces = self.pieces.staged(copy)

        def unavailable() -> torch.Tensor:
            raise RuntimeError(f"a staged checkpoint value ({self._what}) is only written by DCP")

        local = LazyChunk(tuple(self.shape), self.dtype, self.device, pieces, pieces.local,
                          unavailable, self._group, self._what, self._offsets)
        return DTensor(local, dtensor_spec(value), requires_grad=False)

    def __create_write_items__(self, fqn: str, obj: DTensor) -> list[WriteItem]:
        if self.materialized:
            return [create_write_items_for_dtensor(fqn, obj)]
        return self.pieces.write_items(fqn)

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        if self.materialized:
            return [ChunkStorageMetadata(offsets=torch.Size(self._offsets), sizes=self.shape)]
        return self.pieces.__create_chunk_list__()

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if self.materialized:
            return self._value
        return self.pieces.view_at(tuple(index.offset))


def lazy_value(shape: torch.Size, chunk_shape: tuple[int, ...], pieces: ShardPieces,
               source: torch.Tensor, convert: Callable[[], torch.Tensor], group: ShardGroup,
               placements: tuple, what: str, device: torch.device) -> DTensor:
    offsets, spec = _placed(group.mesh, torch.Size(shape), pieces.dtype, tuple(placements))
    local = LazyChunk(chunk_shape, pieces.dtype, device, pieces, source, convert, group, what,
                      offsets)
    return DTensor(local, spec, requires_grad=False)


_PLACED: "weakref.WeakKeyDictionary[Any, dict[tuple, tuple[tuple[int, ...], Any]]]" = \
    weakref.WeakKeyDictionary()
"""Per mesh and (shape, dtype, placements): chunk offsets and
``DTensorSpec``, made once."""


def _placed(mesh: Any, shape: torch.Size, dtype: torch.dtype, placements: tuple
            ) -> tuple[tuple[int, ...], Any]:
    known = _PLACED.setdefault(mesh, {})
    key = (shape, dtype, placements)
    found = known.get(key)
    if found is not None and found[1].mesh is mesh:  # not an equal mesh's
        return found
    _, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    stride = tuple(torch.empty(shape, device="meta").stride())
    spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(shape, stride, dtype))
    found = known[key] = (tuple(offsets), spec)
    return found


def is_lazy(buffer: FlatBuffer, index: int) -> bool:
    """Every non-scalar parameter of the flat layouts but tensor-parallel and
    ``Shard(d)`` ones."""
    record = buffer.records[index]
    return has_pieces(buffer, index) and shard_dim(record) is None and len(record.shape) > 0


def in_place(value: Any, source: Optional[torch.Tensor]) -> bool:
    """What DCP loaded into ``value`` is in ``source`` already."""
    local = local_tensor(value) if isinstance(value, DTensor) else None
    return isinstance(local, LazyChunk) and not local.materialized and local.source is source
