"""A flat buffer's parameters pointed at whole values and back.

Invariant: between :func:`point_params_at` and :func:`keep_own_slice` each
``.data`` is its whole value in its own shape; after, its local view again.
"""

from __future__ import annotations

import torch

from ..buffers.flat_buffer import FlatBuffer
from ..comm.wire import all_gather_into

Assembled = dict[int, torch.Tensor]
"""Per parameter index, a whole copy (values not one run of the buffer)."""


def gather_values(buffer: FlatBuffer) -> torch.Tensor:
    """``buffer``'s padded flat values; blocking, not observed (between steps)."""
    full = torch.empty(buffer.layout.padded_numel, dtype=buffer.dtype,
                       device=buffer.compute_device)
    all_gather_into(full, buffer.sharded.to(buffer.compute_device), buffer.group)
    return full


def _whole_from(buffer: FlatBuffer, full: torch.Tensor, index: int) -> torch.Tensor:
    layout = buffer.layout
    parts = [full.narrow(0, s.start, s.length) for s in layout.segments()
             if s.param_index == index]
    stored = (parts[0] if len(parts) == 1 else torch.cat(parts)).view(layout.stored_shapes[index])
    d = layout.moved_dims()[index]
    return stored.movedim(0, d) if d else stored


def point_params_at(buffer: FlatBuffer, full: torch.Tensor) -> Assembled:
    """Point every ``.data`` at its whole value in ``full``; returns the
    copies handed out, which :func:`keep_own_slice` writes back."""
    assembled: Assembled = {}
    moved = buffer.layout.moved_dims()
    for index, record in enumerate(buffer.records):
        whole = _whole_from(buffer, full, index)
        if not buffer.layout.is_contiguous(index) or moved[index]:
            # a contiguous copy in the parameter's dim order: random initialisers fill
            # memory in order, as an eager build does
            whole = whole.contiguous()
            assembled[index] = whole
        record.param.data = whole
    return assembled


def keep_own_slice(buffer: FlatBuffer, full: torch.Tensor, assembled: Assembled) -> None:
    """Write ``assembled`` back, copy this rank's chunk into the shard, point
    the parameters at their local views."""
    layout = buffer.layout
    moved = layout.moved_dims()
    for index, whole in assembled.items():
        d = moved[index]
        flat = (whole.movedim(d, 0) if d else whole).reshape(-1)
        for s in layout.segments():
            if s.param_index == index:
                full.narrow(0, s.start, s.length).copy_(flat.narrow(0, s.param_start, s.length))
    start, end = layout.shard_range(buffer.group.rank)
    with torch.no_grad():
        buffer.sharded.copy_(full[start:end])
    point_params_at_shard(buffer)


def point_params_at_shard(buffer: FlatBuffer) -> None:
    """Each ``.data`` its local view of the shard again."""
    for index, record in enumerate(buffer.records):
        record.param.data = buffer.local_view(buffer.sharded, index)
