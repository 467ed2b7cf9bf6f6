"""A flat buffer's parameters pointed at whole values and back: what
deferred initialisation (``init.py``) and ``full_params`` (``full_params.py``)
do between an all-gather of a buffer's values and keeping this rank's slice.

Invariant: between :func:`point_params_at` and :func:`keep_own_slice` every
parameter's ``.data`` holds its whole value in its own shape; after
:func:`keep_own_slice` (or :func:`point_params_at_shard`) it is its local
view of the shard again.
"""

from __future__ import annotations

import torch

from ..buffers.flat_buffer import FlatBuffer

Assembled = dict[int, torch.Tensor]
"""Per parameter index, a whole copy handed out because its values are not
one run of the gathered buffer (or are stored with a dim moved first)."""


def _whole_from(buffer: FlatBuffer, full: torch.Tensor, index: int) -> torch.Tensor:
    """Parameter ``index`` of ``full`` (a padded unsharded buffer) in its
    own shape: a view where it is contiguous there, else an assembled copy."""
    layout = buffer.layout
    parts = [full.narrow(0, s.start, s.length) for s in layout.segments()
             if s.param_index == index]
    stored = (parts[0] if len(parts) == 1 else torch.cat(parts)).view(layout.stored_shapes[index])
    d = layout.moved_dims()[index]
    return stored.movedim(0, d) if d else stored


def point_params_at(buffer: FlatBuffer, full: torch.Tensor) -> Assembled:
    """Make every parameter's ``.data`` its whole value (original shape) in
    ``full`` (from ``collective_queue.gather_values``), e.g. so that an
    initialiser sees whole parameters. Returns the copies handed out, which
    :func:`keep_own_slice` writes back."""
    assembled: Assembled = {}
    moved = buffer.layout.moved_dims()
    for index, record in enumerate(buffer.records):
        whole = _whole_from(buffer, full, index)
        if not buffer.layout.is_contiguous(index) or moved[index]:
            # a contiguous copy in the parameter's own dim order: random
            # initialisers fill memory in order, so a movedim view would draw
            # the same values into other positions than an eager build
            whole = whole.contiguous()
            assembled[index] = whole
        record.param.data = whole
    return assembled


def keep_own_slice(buffer: FlatBuffer, full: torch.Tensor, assembled: Assembled) -> None:
    """Write ``assembled`` back into ``full``, copy this rank's chunk of it
    into the shard and point the parameters at their local views again."""
    layout = buffer.layout
    moved = layout.moved_dims()
    for index, whole in assembled.items():
        d = moved[index]
        flat = (whole.movedim(d, 0) if d else whole).reshape(-1)  # in stored order
        for s in layout.segments():
            if s.param_index == index:
                full.narrow(0, s.start, s.length).copy_(flat.narrow(0, s.param_start, s.length))
    start, end = layout.shard_range(buffer.group.rank)
    with torch.no_grad():
        buffer.sharded.copy_(full[start:end])
    point_params_at_shard(buffer)


def point_params_at_shard(buffer: FlatBuffer) -> None:
    """Each parameter's ``.data`` its local view of the shard again (1-D
    under ``"flat"``, ``(rows_here, *rest)`` under the other placements)."""
    for index, record in enumerate(buffer.records):
        record.param.data = buffer.local_view(buffer.sharded, index)
