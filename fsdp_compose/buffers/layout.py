"""Flat layout math: where each original parameter lives in a flat buffer and
which slice of it each rank owns.

Pure functions over (shapes, sharding factor, rank); nothing here touches
``torch.distributed`` or allocates tensors, so it is property-tested alone
(``tests/test_layout.py``).

Invariants of a :class:`FlatLayout` with sharding factor ``F``:

* ``offsets[i]`` is the running sum of ``numels[:i]``; ``numel`` is their sum;
* ``padded_numel`` is the smallest multiple of ``F`` that is ``>= numel``
  (and at least ``F``), so the padding ``padded_numel - numel`` is at most
  ``F - 1`` for a non-empty buffer (units never build empty ones);
* rank ``r`` owns the contiguous chunk ``[r * shard_numel, (r + 1) * shard_numel)``
  with ``shard_numel = padded_numel // F``;
* each original parameter intersects a rank's chunk in one contiguous range,
  possibly empty (:meth:`FlatLayout.shard_slices`).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence


class ShardSlice(NamedTuple):
    """The part of one original parameter that one rank owns.

    Attributes:
        param_index: index of the parameter in the layout.
        param_start: first owned element, as an offset into the flattened
            parameter (0 <= param_start <= numel of the parameter).
        shard_start: where that element sits in the rank's shard.
        length: number of owned elements (0 when the rank owns none; then the
            two starts are clamped to the nearest valid position).
    """

    param_index: int
    param_start: int
    shard_start: int
    length: int


class FlatLayout:
    """Layout of a flat buffer holding parameters of the given shapes,
    sharded over ``world_size`` ranks."""

    __slots__ = ("shapes", "numels", "offsets", "numel", "world_size",
                 "padded_numel", "shard_numel")

    def __init__(self, shapes: Sequence[Sequence[int]], world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.shapes: tuple[tuple[int, ...], ...] = tuple(tuple(int(d) for d in s) for s in shapes)
        self.numels: tuple[int, ...] = tuple(math.prod(s) for s in self.shapes)
        offsets, running = [], 0
        for n in self.numels:
            offsets.append(running)
            running += n
        self.offsets: tuple[int, ...] = tuple(offsets)
        self.numel: int = running  # without padding
        self.world_size: int = world_size
        self.padded_numel: int = max(_round_up(running, world_size), world_size)
        self.shard_numel: int = self.padded_numel // world_size  # includes padding

    @property
    def padding(self) -> int:
        """Number of padding elements at the end of the unsharded buffer."""
        return self.padded_numel - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Half-open range ``[start, end)`` of the unsharded buffer that
        ``rank`` owns (may include padding)."""
        self._check_rank(rank)
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def shard_slices(self, rank: int) -> tuple[ShardSlice, ...]:
        """For every parameter (in layout order), the part ``rank`` owns.

        The result has one entry per parameter; entries with ``length == 0``
        mean the rank owns nothing of that parameter.
        """
        lo, hi = self.shard_range(rank)
        slices = []
        for index, (offset, n) in enumerate(zip(self.offsets, self.numels)):
            start = min(max(lo, offset), offset + n)
            end = max(min(hi, offset + n), start)
            slices.append(ShardSlice(
                param_index=index,
                param_start=start - offset,
                shard_start=min(max(start - lo, 0), self.shard_numel),
                length=end - start,
            ))
        return tuple(slices)

    def owner_ranks(self, index: int) -> range:
        """Ranks whose chunk intersects parameter ``index`` (empty range for a
        parameter with no elements)."""
        n = self.numels[index]
        if n == 0:
            return range(0)
        first = self.offsets[index] // self.shard_numel
        last = (self.offsets[index] + n - 1) // self.shard_numel
        return range(first, last + 1)

    def describe(self) -> tuple:
        """A hashable summary used to check that ranks agree on the layout."""
        return (self.shapes, self.world_size)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")

    def __repr__(self) -> str:
        return (f"FlatLayout(numel={self.numel}, padded={self.padded_numel}, "
                f"world_size={self.world_size}, params={len(self.shapes)})")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
