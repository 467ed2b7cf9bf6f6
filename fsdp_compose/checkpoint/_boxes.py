"""Pure math for the zero-copy checkpoint path: a rank's piece of a parameter
as DCP *boxes* (offsets and sizes in the global shape). DCP reads the
intersections of the boxes it wants with those on disk, whoever wrote
them, so a piece may be written as it lies. A contiguous range of an
``n``-dim parameter is at most ``2n - 1`` boxes (:func:`range_boxes`).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence


class Box(NamedTuple):
    """One box: ``offsets`` and ``sizes`` per dimension, ``flat_start`` its first element in the
    flattened parameter (a box is contiguous there)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Elements ``[start, stop)`` of the flattened tensor of ``shape`` as boxes in increasing
    order. A 0-dim tensor's element is the box ``((), ())``."""
    shape = tuple(shape)
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"range [{start}, {stop}) is not inside a tensor of shape {shape}")
    if start == stop:
        return []
    return _boxes(shape, start, stop, (), 0)


def _boxes(shape: tuple[int, ...], start: int, stop: int, prefix: tuple[int, ...],
           base: int) -> list[Box]:
    """Boxes of ``[start, stop)`` inside a sub-tensor at outer indices ``prefix`` and flat offset
    ``base``."""
    ones = (1,) * len(prefix)
    if len(shape) <= 1:
        offsets = (start,) if shape else ()
        sizes = (stop - start,) if shape else ()
        return [Box(prefix + offsets, ones + sizes, base + start)]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
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
    """Rows ``[lo, hi)`` of dimension ``dim``: the piece of a ``Shard(dim)`` parameter
    (``flat_start`` in stored order)."""
    shape = tuple(shape)
    offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
    sizes = tuple(hi - lo if d == dim else n for d, n in enumerate(shape))
    return Box(offsets, sizes, lo * (math.prod(shape) // shape[dim] if shape[dim] else 0))
