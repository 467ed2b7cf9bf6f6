"""Flat layout math: where each original parameter lives in a flat buffer,
where padding goes, and which piece of each parameter each rank owns.

Pure functions of (shapes, placements, sharding factor, alignment, rank),
without ``torch.distributed`` or tensors, property-tested alone
(``tests/buffers/test_layout.py``, ``tests/core/test_placements.py``).

Placements (docs/placements.md) decide only where each parameter and the
padding sit; the buffer stays ``F`` equal chunks of ``S`` elements, one
all-gather and one reduce-scatter:

* ``"flat"``: element granularity, parameters back to back, padding at the end;
* ``"rows"`` / :class:`Blocks` ``(n)``: a rank boundary only falls at a row
  (``n``-row) boundary of the *stored* parameter; padding only between tensors;
* ``"owned"``: every parameter whole in one rank's chunk, assigned largest
  first onto the least loaded rank; padding fills each chunk to the largest;
* :class:`ShardDim` ``(d)`` (FSDP2's ``Shard(d)``): ``torch.chunk`` of the
  parameter on dim ``d``; it is *stored* with ``d`` moved to the front, rank
  ``r``'s chunk of rows lives in rank ``r``'s chunk of the buffer.

The first three place a parameter in one contiguous range (``offsets[i]``,
``numels[i]``): a *stream* layout. Owned and ``ShardDim`` parameters are
*fixed* to ranks; a ``ShardDim`` parameter is in general not contiguous.
One layout holds one kind (``records.group_records`` splits them).

Invariants of a :class:`FlatLayout` with sharding factor ``F`` and alignment
``A`` (elements; ``16 // itemsize`` makes every chunk start 16-byte aligned):

* ``shard_numel`` ``S`` is a multiple of ``A``; ``padded_numel == F * S``;
  rank ``r`` owns ``[r * S, (r + 1) * S)``;
* every element of every parameter lies in exactly one rank's chunk, in one
  piece per rank (:meth:`FlatLayout.shard_slices`), a contiguous range of the
  flattened stored parameter; for rows/blocks/owned/``ShardDim`` a piece is
  whole rows (``n``-row blocks) of it;
* :meth:`FlatLayout.segments` cuts ``[0, F * S)`` into pieces of parameters
  and gaps (padding), in increasing order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

from ..placements import Blocks

FLAT, ROWS, OWNED = "flat", "rows", "owned"
DEFAULT_PLACEMENT = ROWS
"""``fully_shard``'s placement when none is given: whole rows, so every
parameter but a 0-dim one keeps ``p.dim()`` between iterations (a scalar is
``"flat"``: shape ``(1,)`` on one rank, ``(0,)`` on the others)."""


@dataclass(frozen=True)
class ShardDim:
    """FSDP2's ``Shard(dim)``: ``torch.chunk(param, F, dim)[rank]`` on each rank.

    Attributes:
        dim: the sharded dimension (non-negative, below the parameter's ndim).
    """

    dim: int


Placement = Union[str, Blocks, ShardDim]
PLACEMENT_NAMES = (FLAT, ROWS, OWNED)


def is_fixed(placement: Placement) -> bool:
    """Owned and ``ShardDim`` parameters are pinned to ranks (a *fixed*
    layout); the others are laid out as a stream."""
    return placement == OWNED or isinstance(placement, ShardDim)


def check_placement(placement: object, shape: Sequence[int], name: str,
                    explicit: bool = True) -> Placement:
    """``placement`` checked against a parameter of ``shape`` called ``name``.

    A unit-wide placement (``explicit=False``) that a 0-dim parameter cannot
    hold falls back to ``"flat"`` for it; a per-parameter one raises. Raises
    ``ValueError`` naming the parameter."""
    if isinstance(placement, str):
        if placement not in PLACEMENT_NAMES:
            raise ValueError(f"parameter '{name}': unknown placement {placement!r}; use one of "
                             f"{', '.join(map(repr, PLACEMENT_NAMES))}, Blocks(n) or Shard(dim)")
    elif isinstance(placement, ShardDim):
        dim = placement.dim
        if not -len(shape) <= dim < len(shape) or len(shape) == 0:
            raise ValueError(f"parameter '{name}' of shape {tuple(shape)} cannot take Shard({dim}):"
                             f" dim must be in [0, {len(shape)}) for a {len(shape)}-dim parameter")
        placement = ShardDim(dim % len(shape))
    elif not isinstance(placement, Blocks):
        raise TypeError(f"parameter '{name}': a placement is 'flat', 'rows', 'owned', Blocks(n) or "
                        f"Shard(dim), got {type(placement).__name__}")
    if len(shape) == 0 and placement != FLAT:
        if not explicit:
            return FLAT
        raise ValueError(f"parameter '{name}' is 0-dim; placement {placement!r} keeps a "
                         "parameter's dimensions, which a scalar cannot do over several ranks. "
                         "Return None (the unit's placement) or 'flat' for it from "
                         "shard_placement_fn, or make it 1-dim.")
    return placement


def stored_shape(shape: Sequence[int], placement: Placement) -> tuple[int, ...]:
    """The shape a parameter has inside the buffer: ``ShardDim(d)`` moves
    ``d`` to the front (``movedim(d, 0)``); the others store it as is."""
    shape = tuple(shape)
    if isinstance(placement, ShardDim) and placement.dim:
        d = placement.dim
        return (shape[d],) + shape[:d] + shape[d + 1:]
    return shape


def alignment(*itemsizes: int) -> int:
    """Elements per 16 bytes of the narrowest of ``itemsizes``: a chunk size
    that is a multiple of it starts every chunk 16-byte aligned in all of
    those dtypes (itemsizes are powers of two)."""
    return max(1, 16 // min(itemsizes))


class ShardSlice(NamedTuple):
    """The part of one original parameter that one rank owns.

    Attributes:
        param_index: index of the parameter in the layout.
        param_start: first owned element, as an offset into the flattened
            *stored* parameter (``stored_shape``; the original for every
            placement but ``ShardDim(d > 0)``).
        shard_start: where that element sits in the rank's shard.
        length: number of owned elements (0 when the rank owns none; then the
            two starts are clamped to the nearest valid position).
    """

    param_index: int
    param_start: int
    shard_start: int
    length: int


class Segment(NamedTuple):
    """A run of the unsharded buffer: part of a parameter, or padding.

    Attributes:
        start: first element in the unsharded buffer.
        length: number of elements.
        param_index: the parameter it belongs to (``-1``: padding).
        param_start: offset of ``start`` in the flattened stored parameter.
    """

    start: int
    length: int
    param_index: int
    param_start: int


class FlatLayout:
    """Layout of a flat buffer holding parameters of the given shapes and
    placements (default ``"flat"``), sharded over ``world_size`` ranks with
    chunks of a multiple of ``align`` elements."""

    __slots__ = ("shapes", "placements", "stored_shapes", "numels", "offsets", "numel",
                 "world_size", "align", "padded_numel", "shard_numel", "_pieces", "_segments")

    def __init__(self, shapes: Sequence[Sequence[int]], world_size: int,
                 placements: Optional[Sequence[Placement]] = None, align: int = 1) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        self.shapes: tuple[tuple[int, ...], ...] = tuple(tuple(int(d) for d in s) for s in shapes)
        if placements is None:
            placements = [FLAT] * len(self.shapes)
        if len(placements) != len(self.shapes):
            raise ValueError(f"{len(placements)} placements for {len(self.shapes)} parameters")
        self.placements: tuple[Placement, ...] = tuple(
            check_placement(p, s, f"#{i}") for i, (p, s) in enumerate(zip(placements, self.shapes)))
        kinds = {is_fixed(p) for p in self.placements}
        if len(kinds) > 1:
            raise ValueError("one flat layout holds either owned/Shard(dim) parameters or "
                             "flat/rows/Blocks ones (group_records splits them)")
        self.stored_shapes: tuple[tuple[int, ...], ...] = tuple(
            stored_shape(s, p) for s, p in zip(self.shapes, self.placements))
        self.numels: tuple[int, ...] = tuple(math.prod(s) for s in self.shapes)
        self.numel: int = sum(self.numels)  # without padding
        self.world_size: int = world_size
        self.align: int = align
        if kinds == {True}:
            shard, pieces, offsets = _plan_fixed(self, world_size, align)
        else:
            shard, offsets = _plan_stream(self, world_size, align)
            pieces = [_cut_by_chunks(i, o, n, shard) for i, (o, n) in enumerate(zip(offsets, self.numels))]
        self.shard_numel: int = shard  # includes padding
        self.padded_numel: int = shard * world_size
        self.offsets: tuple[int, ...] = tuple(offsets)
        """Where each parameter starts in the unsharded buffer (its first
        piece's start; a stream parameter is contiguous from there)."""
        self._pieces: tuple[tuple[Segment, ...], ...] = tuple(tuple(p) for p in pieces)
        """Per parameter, its nonempty pieces in increasing order."""
        self._segments: tuple[Segment, ...] = self._cut_into_segments()

    # ------------------------------------------------------------- queries
    @property
    def padding(self) -> int:
        """Number of padding elements in the unsharded buffer."""
        return self.padded_numel - self.numel

    def row_numel(self, index: int) -> int:
        """Elements per row of the stored parameter (1 for 0- and 1-dim)."""
        shape = self.stored_shapes[index]
        return math.prod(shape[1:]) if len(shape) > 1 else 1

    def is_contiguous(self, index: int) -> bool:
        """Whether the parameter is one contiguous range of the unsharded buffer."""
        pieces = self._pieces[index]
        return all(a.start + a.length == b.start for a, b in zip(pieces, pieces[1:]))

    def moved_dims(self) -> tuple[int, ...]:
        """Per parameter, the dim stored first: ``d`` for ``ShardDim(d)``
        (its rows are dealt along ``d``), else 0 (none moved)."""
        return tuple(p.dim if isinstance(p, ShardDim) else 0 for p in self.placements)

    def keeps_shape(self, index: int) -> bool:
        """Whether each rank's piece is whole rows (viewable as
        ``(rows, *stored_shape[1:])``); flat pieces are 1-D."""
        return self.placements[index] != FLAT

    def local_shape(self, index: int, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s piece of parameter ``index``, in stored order."""
        length = self.shard_slices(rank)[index].length
        if not self.keeps_shape(index):
            return (length,)
        shape = self.stored_shapes[index]
        row = self.row_numel(index)
        if row:
            return (length // row, *shape[1:])
        # no elements (a 0-size dim after the first): rows as torch.chunk would deal
        # them (ShardDim), else all on the rank where the parameter sits
        if isinstance(self.placements[index], ShardDim):
            per_rank = -(-shape[0] // self.world_size)
            rows = max(0, min(shape[0] - rank * per_rank, per_rank))
        else:
            rows = shape[0] if rank == self.offsets[index] // self.shard_numel else 0
        return (rows, *shape[1:])

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
        for index, pieces in enumerate(self._pieces):
            mine = [p for p in pieces if lo <= p.start < hi]
            if mine:
                p = mine[0]
                slices.append(ShardSlice(index, p.param_start, p.start - lo, p.length))
                continue
            # none here: clamp to where it would be, as the flat math always did
            offset, n = self.offsets[index], self.numels[index]
            start = min(max(lo, offset), offset + n) if self.is_contiguous(index) else offset
            slices.append(ShardSlice(index, min(max(start - offset, 0), n),
                                     min(max(start - lo, 0), self.shard_numel), 0))
        return tuple(slices)

    def largest_piece(self, index: int) -> int:
        """The most elements of parameter ``index`` that one rank holds."""
        return max((p.length for p in self._pieces[index]), default=0)

    def owner_ranks(self, index: int) -> range:
        """Ranks whose chunk intersects parameter ``index`` (empty range for a
        parameter with no elements). Consecutive for every placement."""
        pieces = self._pieces[index]
        if not pieces:
            return range(0)
        return range(pieces[0].start // self.shard_numel, pieces[-1].start // self.shard_numel + 1)

    def rank_numels(self) -> tuple[int, ...]:
        """Parameter elements (no padding) in each rank's chunk."""
        loads = [0] * self.world_size
        for pieces in self._pieces:
            for p in pieces:
                loads[p.start // self.shard_numel] += p.length
        return tuple(loads)

    def segments(self) -> tuple[Segment, ...]:
        """``[0, padded_numel)`` cut into parameters and padding, in
        increasing order, each segment starting where the previous ends: one
        segment per parameter that is contiguous in the buffer (an empty one,
        where the order reaches it, for a parameter with no elements), one
        per piece of one that is not (``ShardDim``)."""
        return self._segments

    def _cut_into_segments(self) -> tuple[Segment, ...]:
        runs = []
        for i, pieces in enumerate(self._pieces):
            if self.is_contiguous(i):  # one run, whatever chunks it crosses (a view, no copy)
                runs.append(Segment(self.offsets[i], self.numels[i], i, 0))
            else:
                runs.extend(pieces)
        runs.sort(key=lambda s: (s.start, s.length))
        out, cursor = [], 0
        for s in runs:
            if s.length == 0:  # a parameter with no elements: an empty segment where we are
                out.append(s._replace(start=cursor))
                continue
            if s.start > cursor:
                out.append(Segment(cursor, s.start - cursor, -1, 0))
            out.append(s)
            cursor = s.start + s.length
        if cursor < self.padded_numel:
            out.append(Segment(cursor, self.padded_numel - cursor, -1, 0))
        return tuple(out)

    def describe(self) -> tuple:
        """A hashable summary used to check that ranks agree on the layout."""
        return (self.shapes, tuple(map(repr, self.placements)), self.world_size, self.align)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")

    def __repr__(self) -> str:
        return (f"FlatLayout(numel={self.numel}, padded={self.padded_numel}, "
                f"world_size={self.world_size}, params={len(self.shapes)})")


# ------------------------------------------------------------------ planners
def _cut_unit(layout: FlatLayout, index: int) -> int:
    """Granularity of rank boundaries inside a stream parameter, in elements."""
    placement = layout.placements[index]
    if placement == FLAT:
        return 1
    rows = placement.n if isinstance(placement, Blocks) else 1
    return rows * layout.row_numel(index)


def _plan_stream(layout: FlatLayout, world: int, align: int) -> tuple[int, list[int]]:
    """Chunk size and offsets for flat/rows/Blocks parameters, in order.

    Tries chunk sizes from the smallest possible upwards; each failed try
    names the next size worth trying, so the loop is short. A parameter that
    crosses a rank boundary is moved forward (padding between tensors) until
    the boundary falls on its cut unit ``u``; one that crosses two or more
    boundaries also needs ``S % u == 0``."""
    units = [_cut_unit(layout, i) for i in range(len(layout.numels))]
    shard = _round_up(max(-(-layout.numel // world), 1), align)
    while True:
        offsets, cursor, retry = [], 0, None
        for n, u in zip(layout.numels, units):
            boundary = (cursor // shard + 1) * shard
            if n and cursor + n > boundary:
                cursor += (boundary - cursor) % u  # the first boundary falls between cut units
                if cursor + n > boundary + shard and shard % u:
                    retry = _round_up(shard + 1, math.lcm(u, align))  # spans a whole chunk
                    break
            offsets.append(cursor)
            cursor += n
        if retry is None and cursor <= shard * world:
            return shard, offsets
        if retry is None:  # overflow: grow every chunk by its share of the excess
            retry = shard + _round_up(-(-(cursor - shard * world) // world), align)
        shard = retry


def _plan_fixed(layout: FlatLayout, world: int,
                align: int) -> tuple[int, list[list[Segment]], list[int]]:
    """Chunk size, pieces and offsets for owned/``ShardDim`` parameters.

    ``ShardDim`` pieces go to their ranks first (``torch.chunk`` rows); then
    owned parameters, largest first, each onto the least loaded rank (lowest
    rank on ties). Within a chunk, pieces keep parameter order; padding ends
    each chunk."""
    count = len(layout.numels)
    loads = [0] * world
    placed: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]  # (index, p_start, len)
    for i, placement in enumerate(layout.placements):
        if isinstance(placement, ShardDim):
            rows, row = layout.stored_shapes[i][0], layout.row_numel(i)
            per_rank = -(-rows // world) if rows else 0
            for r in range(world):
                lo, hi = min(r * per_rank, rows), min((r + 1) * per_rank, rows)
                if hi > lo and row:
                    placed[r].append((i, lo * row, (hi - lo) * row))
                    loads[r] += (hi - lo) * row
    owned = sorted((i for i in range(count) if layout.placements[i] == OWNED),
                   key=lambda i: (-layout.numels[i], i))
    owner_of: dict[int, int] = {}
    for i in owned:
        r = min(range(world), key=lambda k: (loads[k], k))
        owner_of[i] = r
        if layout.numels[i]:
            placed[r].append((i, 0, layout.numels[i]))
            loads[r] += layout.numels[i]
    _rebalance(placed, loads, set(owned))
    shard = _round_up(max(max(loads), 1), align)
    pieces: list[list[Segment]] = [[] for _ in range(count)]
    for r in range(world):
        cursor = r * shard
        for i, p_start, length in sorted(placed[r]):
            pieces[i].append(Segment(cursor, length, i, p_start))
            cursor += length
    owner_of.update({i: r for r in range(world) for i, _, _ in placed[r]})
    offsets = []
    for i in range(count):
        if pieces[i]:
            offsets.append(pieces[i][0].start)
        else:  # empty: where its owner's chunk starts (any rank for a 0-row ShardDim)
            offsets.append(owner_of.get(i, 0) * shard)
    return shard, pieces, offsets


def _rebalance(placed: list[list[tuple[int, int, int]]], loads: list[int],
               movable: set[int]) -> None:
    """Improve a largest-first assignment by moving one owned parameter
    between two ranks, or swapping two, where that narrows the pair's
    spread: first pairs with the most loaded rank (lowers the chunk size),
    then pairs with the least loaded one (lifts the smallest load). Each
    step lowers the sum of squared loads, so it ends. Deterministic: every
    rank computes the same."""
    world = len(loads)
    while True:
        hi = max(range(world), key=lambda k: (loads[k], -k))
        lo = min(range(world), key=lambda k: (loads[k], k))
        step = _best_exchange(placed, loads, movable, hi, True) or \
            _best_exchange(placed, loads, movable, lo, False)
        if step is None:
            return
        src, dst, a, b = step
        placed[src].remove(a)
        placed[dst].append(a)
        delta = a[2]
        if b is not None:
            placed[dst].remove(b)
            placed[src].append(b)
            delta -= b[2]
        loads[src] -= delta
        loads[dst] += delta


def _best_exchange(placed, loads, movable, pivot: int, pivot_is_high: bool):
    """The move or swap between ``pivot`` and another rank that best lowers
    (``pivot_is_high``) or lifts the pivot's load without crossing the other
    rank's: ``(from rank, to rank, item moved, item moved back or None)``."""
    best = None
    for other in range(len(loads)):
        src, dst = (pivot, other) if pivot_is_high else (other, pivot)
        if src == dst or loads[src] <= loads[dst]:
            continue
        for a in placed[src]:
            if a[0] not in movable:
                continue
            for b in [None] + [b for b in placed[dst] if b[0] in movable and b[2] < a[2]]:
                delta = a[2] - (0 if b is None else b[2])
                if delta >= loads[src] - loads[dst]:
                    continue  # would not narrow the pair
                score = loads[src] - delta if pivot_is_high else -(loads[dst] + delta)
                if best is None or score < best[0]:
                    best = (score, src, dst, a, b)
    return None if best is None else best[1:]


def _cut_by_chunks(index: int, offset: int, numel: int, shard: int) -> list[Segment]:
    """A contiguous parameter at ``offset`` cut at the chunk boundaries."""
    out, start = [], offset
    end = offset + numel
    while start < end:
        stop = min(end, (start // shard + 1) * shard)
        out.append(Segment(start, stop - start, index, start - offset))
        start = stop
    return out


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
