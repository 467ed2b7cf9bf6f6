"""The default placement's rule (``fully_shard(placement=None)``): which
parameters leave ``"rows"`` for ``"flat"`` because whole rows would pad
their buffer much more, and, on a CPU mesh, which get a buffer of their own
so no rank holds much more of them than FSDP2's ``Shard(0)``. Runs once at
annotation, changing the records' ``placement`` and ``own_buffer``.
"""

from __future__ import annotations

import math

from ..buffers.layout import FLAT, ROWS, FlatLayout, alignment, is_fixed
from ..buffers.records import ParamRecord, group_records


ROWS_EXTRA_PADDING = 0.01
"""The most extra padding (a fraction of the buffer's elements, or one
alignment unit per rank) ``"rows"`` may cost over ``"flat"``."""


def flatten_costly_rows(records: list[ParamRecord], candidates: list[ParamRecord],
                        world_size: int) -> list[ParamRecord]:
    """Make the widest of ``candidates`` ``"flat"``, widest first, until each
    buffer's padding is within :data:`ROWS_EXTRA_PADDING` of ``"flat"``'s.
    Returns those made ``"flat"``."""
    wanted = {id(r) for r in candidates}
    flattened: list[ParamRecord] = []
    for group in group_records(records):
        movable = sorted((r for r in group if id(r) in wanted and r.placement == ROWS),
                         key=lambda r: -math.prod(r.shape[1:]))
        if not movable:
            continue
        align = alignment(group[0].param.dtype.itemsize, 2)
        shapes = [r.shape for r in group]

        def padding(flat: set[int]) -> int:
            placements = [FLAT if id(r) in flat else r.placement for r in group]
            return FlatLayout(shapes, world_size, placements, align).padding

        numel = sum(math.prod(shape) for shape in shapes)
        budget = padding({id(r) for r in movable}) + max(ROWS_EXTRA_PADDING * numel,
                                                          world_size * align)
        flat: set[int] = set()
        for record in movable:
            if padding(flat) <= budget:
                break
            flat.add(id(record))
            record.placement = FLAT
            flattened.append(record)
    return flattened


HOST_PIECE_SLACK_BYTES = 4 * 2 ** 20
"""How much a rank's largest piece of a trainable parameter may exceed
FSDP2's before :func:`split_whole_pieces` acts (each split costs a
collective per step)."""


def largest_share_bytes(record: ParamRecord, world_size: int) -> int:
    """The largest piece of ``record``'s parameter, in bytes, one rank holds
    under ``Shard(0)`` (``torch.chunk``)."""
    shape = record.shape
    rows = -(-shape[0] // world_size) if shape else 1
    return rows * math.prod(shape[1:]) * record.param.dtype.itemsize


def split_whole_pieces(records: list[ParamRecord], candidates: list[ParamRecord],
                       world_size: int) -> list[ParamRecord]:
    """On a CPU mesh: while some rank holds a piece of a candidate larger than
    the unit's largest ``Shard(0)`` piece (plus :data:`HOST_PIECE_SLACK_BYTES`
    the first time), give the largest such candidate a buffer of its own.
    Returns those split.

    Why: torch's CPU optimizers (no ``foreach``) make temporaries the size of
    each piece, and rank boundaries can put a whole parameter on one rank; on
    CUDA (``foreach``) the layout does not change the peak.

    Post-condition: every candidate's largest piece is at most that
    ``Shard(0)`` piece (plus the slack if nothing was split), or what it would
    be alone in a buffer."""
    trainable = [r for r in records if r.param.requires_grad and r.group is None]
    movable = [r for r in candidates if r.param.requires_grad and r.group is None
               and r.tp is None and r.shape and not is_fixed(r.placement)]
    if not movable:
        return []
    bound = max(largest_share_bytes(r, world_size) for r in trainable)
    alone: dict[int, int] = {}  # by record id, made for the records over the bound only

    def piece_alone(record: ParamRecord) -> int:
        if id(record) not in alone:
            alone[id(record)] = _largest_pieces([record], world_size)[id(record)]
        return alone[id(record)]

    slack = HOST_PIECE_SLACK_BYTES
    split: list[ParamRecord] = []
    while True:
        pieces = _largest_pieces(records, world_size)
        over = [r for r in movable if not r.own_buffer and pieces.get(id(r), 0) > bound + slack
                and piece_alone(r) < pieces[id(r)]]
        if not over:
            return split
        record = max(over, key=lambda r: pieces[id(r)])
        record.own_buffer = True
        split.append(record)
        slack = 0


def _largest_pieces(records: list[ParamRecord], world_size: int) -> dict[int, int]:
    """Per record (by id), the largest piece of it one rank holds, in bytes,
    under the current grouping."""
    pieces: dict[int, int] = {}
    for group in group_records(records):
        first = group[0]
        if is_fixed(first.placement):
            continue
        itemsize = first.param.dtype.itemsize
        layout = FlatLayout([r.shape for r in group], world_size, [r.placement for r in group],
                            alignment(itemsize, 2))
        for index, r in enumerate(group):
            pieces[id(r)] = layout.largest_piece(index) * itemsize
    return pieces
