"""Pure math for the zero-copy checkpoint path: a rank's piece of a
parameter as DCP *boxes* (``ChunkStorageMetadata``: offsets and sizes in the
parameter's global shape).

DCP stores every tensor as a set of boxes that together cover it without
overlap, whoever wrote them; any reader (torch FSDP2's ``Shard(0)`` chunks, a
plain model's whole tensors, another world size) reads the intersections of
the boxes it wants with the boxes on disk. So a rank may write its piece of
a flat shard as it lies, with no exchange and no copy, as long as the piece
is cut into boxes.

A rank's piece of a parameter under ``"flat"``, ``"rows"``, ``Blocks(n)`` and
``"owned"`` is one contiguous range ``[start, stop)`` of the row-major
flattened parameter. Such a range is a union of boxes, each itself a
contiguous range: for a 2-D parameter at most three (a partial first row,
whole rows, a partial last row), one when the range is whole rows; in ``n``
dims, recursively, at most ``2n - 1``. :func:`range_boxes` returns them in
increasing order, so the piece's memory is cut into consecutive runs.

Nothing here imports ``torch.distributed`` or allocates tensors; it is
property-tested in ``tests/checkpoint/test_checkpoint_flat.py``.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence


class Box(NamedTuple):
    """One box of a parameter of some global shape.

    Attributes:
        offsets: its first index in every dimension.
        sizes: its extent in every dimension.
        flat_start: offset of its first element in the flattened parameter
            (the box is the contiguous range ``[flat_start, flat_start +
            prod(sizes))`` of it).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Elements ``[start, stop)`` of the row-major flattened tensor of
    ``shape``, as boxes in increasing order (none when the range is empty).
    A 0-dim tensor's one element is the box ``((), ())``."""
    shape = tuple(shape)
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"range [{start}, {stop}) is not inside a tensor of shape {shape}")
    if start == stop:
        return []
    return _boxes(shape, start, stop, (), 0)


def _boxes(shape: tuple[int, ...], start: int, stop: int, prefix: tuple[int, ...],
           base: int) -> list[Box]:
    """Boxes of ``[start, stop)`` (non-empty) inside a sub-tensor of ``shape``
    whose element 0 is at ``prefix`` (indices of the outer dimensions, each
    of extent 1) and at ``base`` in the whole flattened tensor."""
    ones = (1,) * len(prefix)
    if len(shape) <= 1:
        offsets = (start,) if shape else ()
        sizes = (stop - start,) if shape else ()
        return [Box(prefix + offsets, ones + sizes, base + start)]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row  # rows holding the first and the last element
    out: list[Box] = []
    if start % row or first == last and stop % row:  # a partial first row (or only one row)
        end = min(stop, (first + 1) * row)
        out += _boxes(shape[1:], start - first * row, end - first * row, prefix + (first,),
                      base + first * row)
        first += 1
        if first > last:
            return out
    whole_end = last + 1 if stop % row == 0 else last  # rows [first, whole_end) are whole
    if whole_end > first:
        out.append(Box(prefix + (first,) + (0,) * (len(shape) - 1),
                       ones + (whole_end - first,) + shape[1:], base + first * row))
    if stop % row:  # a partial last row
        out += _boxes(shape[1:], 0, stop - last * row, prefix + (last,), base + last * row)
    return out


def dim_box(shape: Sequence[int], dim: int, lo: int, hi: int) -> Box:
    """Rows ``[lo, hi)`` of dimension ``dim`` (all of the others): the piece
    of a ``Shard(dim)`` parameter. ``flat_start`` is that of the stored
    order (``dim`` moved to the front), where the piece is contiguous."""
    shape = tuple(shape)
    offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
    sizes = tuple(hi - lo if d == dim else n for d, n in enumerate(shape))
    return Box(offsets, sizes, lo * (math.prod(shape) // shape[dim] if shape[dim] else 0))
