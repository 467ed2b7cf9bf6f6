"""Flat layout math: where each parameter and the padding sit in a flat buffer and which piece
each rank owns; pure functions, property-tested alone.

The buffer is ``F`` chunks of ``S`` elements, rank ``r`` owning
``[r*S, (r+1)*S)``, ``S`` a multiple of the alignment; placements
(docs/placements.md) move only parameters and padding. ``"flat"``,
``"rows"`` and :class:`Blocks` are a *stream* (each parameter one contiguous
range); ``"owned"`` and :class:`ShardDim` are *fixed* to ranks; a layout
holds one kind. A rank's piece of a parameter is one contiguous range of
its flattened stored shape, whole rows under every placement but ``"flat"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

from ..placements import Blocks

FLAT, ROWS, OWNED = "flat", "rows", "owned"
DEFAULT_PLACEMENT = ROWS
"""Whole rows: every parameter but a 0-dim one keeps ``p.dim()``."""


@dataclass(frozen=True)
class ShardDim:
    """FSDP2's ``Shard(dim)``: ``torch.chunk(param, F, dim)[rank]`` on each rank.

    Attributes:
        dim: the sharded dimension (non-negative, below the parameter's ndim)."""

    dim: int


Placement = Union[str, Blocks, ShardDim]
PLACEMENT_NAMES = (FLAT, ROWS, OWNED)


def is_fixed(placement: Placement) -> bool:
    return placement == OWNED or isinstance(placement, ShardDim)


def check_placement(placement: object, shape: Sequence[int], name: str,
                    explicit: bool = True) -> Placement:
    """``placement`` checked for parameter ``name`` (``ValueError`` naming it);
    a unit-wide one (``explicit=False``) falls back to ``"flat"`` for a 0-dim
    parameter."""
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
    shape = tuple(shape)
    if isinstance(placement, ShardDim) and placement.dim:
        d = placement.dim
        return (shape[d],) + shape[:d] + shape[d + 1:]
    return shape


def alignment(*itemsizes: int) -> int:
    """Elements per 16 bytes of the narrowest of ``itemsizes`` (chunks of a multiple start
    aligned)."""
    return max(1, 16 // min(itemsizes))


class ShardSlice(NamedTuple):
    """The part of one parameter one rank owns: ``length`` elements from
    ``param_start`` of the flattened *stored* parameter, at ``shard_start`` of
    the shard (``length == 0``: none; starts clamped)."""

    param_index: int
    param_start: int
    shard_start: int
    length: int


class Segment(NamedTuple):
    """A run of the unsharded buffer: ``length`` elements from ``start``, part of parameter
    ``param_index`` from its ``param_start`` (``-1``: padding)."""

    start: int
    length: int
    param_index: int
    param_start: int


class FlatLayout:
    """Layout of a flat buffer of parameters of ``shapes`` and ``placements`` over ``world_size``
    ranks, chunks a multiple of ``align`` elements."""

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
        self.numel: int = sum(self.numels)
        self.world_size: int = world_size
        self.align: int = align
        if kinds == {True}:
            shard, pieces, offsets = _plan_fixed(self, world_size, align)
        else:
            shard, offsets = _plan_stream(self, world_size, align)
            pieces = [_cut_by_chunks(i, o, n, shard) for i, (o, n) in enumerate(zip(offsets, self.numels))]
        self.shard_numel: int = shard
        self.padded_numel: int = shard * world_size
        self.offsets: tuple[int, ...] = tuple(offsets)
        """Where each parameter's first piece starts in the unsharded buffer."""
        self._pieces: tuple[tuple[Segment, ...], ...] = tuple(tuple(p) for p in pieces)
        self._segments: tuple[Segment, ...] = self._cut_into_segments()

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def row_numel(self, index: int) -> int:
        shape = self.stored_shapes[index]
        return math.prod(shape[1:]) if len(shape) > 1 else 1

    def is_contiguous(self, index: int) -> bool:
        pieces = self._pieces[index]
        return all(a.start + a.length == b.start for a, b in zip(pieces, pieces[1:]))

    def moved_dims(self) -> tuple[int, ...]:
        return tuple(p.dim if isinstance(p, ShardDim) else 0 for p in self.placements)

    def keeps_shape(self, index: int) -> bool:
        """Each rank's piece is whole rows; flat pieces are 1-D."""
        return self.placements[index] != FLAT

    def local_shape(self, index: int, rank: int) -> tuple[int, ...]:
        length = self.shard_slices(rank)[index].length
        if not self.keeps_shape(index):
            return (length,)
        shape = self.stored_shapes[index]
        row = self.row_numel(index)
        if row:
            return (length // row, *shape[1:])
        # no elements: rows as torch.chunk deals them (ShardDim), else all where the parameter sits
        if isinstance(self.placements[index], ShardDim):
            per_rank = -(-shape[0] // self.world_size)
            rows = max(0, min(shape[0] - rank * per_rank, per_rank))
        else:
            rows = shape[0] if rank == self.offsets[index] // self.shard_numel else 0
        return (rows, *shape[1:])

    def shard_range(self, rank: int) -> tuple[int, int]:
        self._check_rank(rank)
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def shard_slices(self, rank: int) -> tuple[ShardSlice, ...]:
        """For every parameter, the part ``rank`` owns (``length == 0``: none)."""
        lo, hi = self.shard_range(rank)
        slices = []
        for index, pieces in enumerate(self._pieces):
            mine = [p for p in pieces if lo <= p.start < hi]
            if mine:
                p = mine[0]
                slices.append(ShardSlice(index, p.param_start, p.start - lo, p.length))
                continue
            # none here: clamp to where it would be
            offset, n = self.offsets[index], self.numels[index]
            start = min(max(lo, offset), offset + n) if self.is_contiguous(index) else offset
            slices.append(ShardSlice(index, min(max(start - offset, 0), n),
                                     min(max(start - lo, 0), self.shard_numel), 0))
        return tuple(slices)

    def largest_piece(self, index: int) -> int:
        return max((p.length for p in self._pieces[index]), default=0)

    def owner_ranks(self, index: int) -> range:
        """Ranks whose chunk intersects parameter ``index`` (consecutive)."""
        pieces = self._pieces[index]
        if not pieces:
            return range(0)
        return range(pieces[0].start // self.shard_numel, pieces[-1].start // self.shard_numel + 1)

    def rank_numels(self) -> tuple[int, ...]:
        loads = [0] * self.world_size
        for pieces in self._pieces:
            for p in pieces:
                loads[p.start // self.shard_numel] += p.length
        return tuple(loads)

    def segments(self) -> tuple[Segment, ...]:
        """``[0, padded_numel)`` cut into parameters and padding, in order (one segment per piece
        of a ``ShardDim`` parameter)."""
        return self._segments

    def _cut_into_segments(self) -> tuple[Segment, ...]:
        runs = []
        for i, pieces in enumerate(self._pieces):
            if self.is_contiguous(i):  # one run, whatever chunks it crosses
                runs.append(Segment(self.offsets[i], self.numels[i], i, 0))
            else:
                runs.extend(pieces)
        runs.sort(key=lambda s: (s.start, s.length))
        out, cursor = [], 0
        for s in runs:
            if s.length == 0:
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
        return (self.shapes, tuple(map(repr, self.placements)), self.world_size, self.align)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")

    def __repr__(self) -> str:
        return (f"FlatLayout(numel={self.numel}, padded={self.padded_numel}, "
                f"world_size={self.world_size}, params={len(self.shapes)})")


def _cut_unit(layout: FlatLayout, index: int) -> int:
    placement = layout.placements[index]
    if placement == FLAT:
        return 1
    rows = placement.n if isinstance(placement, Blocks) else 1
    return rows * layout.row_numel(index)


def _plan_stream(layout: FlatLayout, world: int, align: int) -> tuple[int, list[int]]:
    """Chunk size and offsets of stream parameters: one crossing a rank boundary moves forward
    until the boundary falls on its cut unit."""
    units = [_cut_unit(layout, i) for i in range(len(layout.numels))]
    shard = _round_up(max(-(-layout.numel // world), 1), align)
    while True:
        offsets, cursor, retry = [], 0, None
        for n, u in zip(layout.numels, units):
            boundary = (cursor // shard + 1) * shard
            if n and cursor + n > boundary:
                cursor += (boundary - cursor) % u
                if cursor + n > boundary + shard and shard % u:
                    retry = _round_up(shard + 1, math.lcm(u, align))  # spans a whole chunk
                    break
            offsets.append(cursor)
            cursor += n
        if retry is None and cursor <= shard * world:
            return shard, offsets
        if retry is None:  # overflow: grow every chunk by its share
            retry = shard + _round_up(-(-(cursor - shard * world) // world), align)
        shard = retry


def _plan_fixed(layout: FlatLayout, world: int,
                align: int) -> tuple[int, list[list[Segment]], list[int]]:
    """Chunk size, pieces and offsets of fixed parameters: ``ShardDim`` rows to
    their ranks, then owned ones largest first onto the least loaded rank;
    padding ends each chunk."""
    count = len(layout.numels)
    loads = [0] * world
    placed: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
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
        else:  # empty: where its owner's chunk starts
            offsets.append(owner_of.get(i, 0) * shard)
    return shard, pieces, offsets


def _rebalance(placed: list[list[tuple[int, int, int]]], loads: list[int],
               movable: set[int]) -> None:
    """Improve a largest-first assignment by moves or swaps of owned parameters
    that narrow a pair's spread; each lowers the sum of squared loads, so it
    ends. Deterministic."""
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
    """The best move or swap between ``pivot`` and another rank, or ``None``."""
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
                    continue
                score = loads[src] - delta if pivot_is_high else -(loads[dst] + delta)
                if best is None or score < best[0]:
                    best = (score, src, dst, a, b)
    return None if best is None else best[1:]


def _cut_by_chunks(index: int, offset: int, numel: int, shard: int) -> list[Segment]:
    out, start = [], offset
    end = offset + numel
    while start < end:
        stop = min(end, (start // shard + 1) * shard)
        out.append(Segment(start, stop - start, index, start - offset))
        start = stop
    return out


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
