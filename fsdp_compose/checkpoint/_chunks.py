"""Pure math between the flat layout and FSDP2's per-parameter ``Shard(0)``
layout. Rank ``j``'s chunks of the selected parameters are increasing
ranges of the flat buffer, so one all-to-all converts: each rank sends
``j`` the parts of ``j``'s ranges in its shard, in order, and what ``j``
receives *is* its chunks back to back; the reverse runs it backwards.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from ..buffers.layout import FlatLayout


class Chunk(NamedTuple):
    """This rank's dim-0 chunk of one parameter: ``numel`` elements of ``shape`` from
    ``row_start``, at ``packed_start`` of the packed chunks."""

    param_index: int
    packed_start: int
    shape: tuple[int, ...]
    numel: int
    row_start: int


class ExchangePlan(NamedTuple):
    """One rank's side of the flat <-> chunks all-to-all: ``chunks`` in flat order,
    ``send_intervals`` of the shard in sending order, and the element counts to and from each
    rank."""

    chunks: tuple[Chunk, ...]
    send_intervals: tuple[tuple[int, int], ...]
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]

    @property
    def packed_numel(self) -> int:
        return sum(self.recv_counts)


def dim0_rows(shape: Sequence[int], world_size: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``torch.chunk(param, world_size, dim=0)[rank]``; 0-dim: ``(0, 1)``."""
    if len(shape) == 0:
        return 0, 1
    rows = shape[0]
    per_rank = -(-rows // world_size)
    return min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)


def chunk_shape(shape: Sequence[int], world_size: int, rank: int) -> tuple[int, ...]:
    if len(shape) == 0:
        return ()
    lo, hi = dim0_rows(shape, world_size, rank)
    return (hi - lo, *shape[1:])


def _target_ranges(layout: FlatLayout, rank: int,
                   selected: Sequence[int]) -> list[tuple[int, int, int, int]]:
    ranges = []
    for index in sorted(selected, key=lambda i: (layout.offsets[i], i)):
        shape = layout.shapes[index]
        lo, hi = dim0_rows(shape, layout.world_size, rank)
        row_numel = 1 if len(shape) == 0 else (
            layout.numels[index] // shape[0] if shape[0] else 0)
        start = layout.offsets[index] + lo * row_numel
        ranges.append((index, start, start + (hi - lo) * row_numel, lo))
    return ranges


def _intersect(ranges: list[tuple[int, int, int, int]], lo: int,
               hi: int) -> list[tuple[int, int]]:
    out = []
    for _, start, end, _ in ranges:
        s, e = max(start, lo), min(end, hi)
        if s < e:
            out.append((s, e))
    return out


def exchange_plan(layout: FlatLayout, rank: int, selected: Sequence[int]) -> ExchangePlan:
    """This rank's side of the all-to-all for the selected parameters (the same on every rank)."""
    world, shard = layout.world_size, layout.shard_numel
    my_lo, my_hi = layout.shard_range(rank)
    mine = _target_ranges(layout, rank, selected)

    chunks, packed = [], 0
    for index, start, end, row_start in mine:
        numel = end - start
        chunks.append(Chunk(index, packed, chunk_shape(layout.shapes[index], world, rank),
                            numel, row_start))
        packed += numel

    send_intervals, send_counts = [], []
    for dest in range(world):
        theirs = mine if dest == rank else _target_ranges(layout, dest, selected)
        parts = _intersect(theirs, my_lo, my_hi)
        send_intervals.extend((s - my_lo, e - s) for s, e in parts)
        send_counts.append(sum(e - s for s, e in parts))

    recv_counts = [sum(e - s for s, e in _intersect(mine, src * shard, (src + 1) * shard))
                   for src in range(world)]
    return ExchangePlan(tuple(chunks), tuple(send_intervals), tuple(send_counts),
                        tuple(recv_counts))
