"""The default placement's rule (``fully_shard(placement=None)``): which
parameters placed by default leave ``"rows"`` for ``"flat"`` because whole
rows would pad their buffer much more, and, on a CPU mesh, which get a
buffer of their own because a rank would otherwise hold much more of them
than FSDP2's ``Shard(0)`` does. Runs once, at annotation, on the records
``setup/units.py`` collected (it changes their ``placement`` and
``own_buffer``); the layout math is ``buffers/layout.py``'s.
"""

from __future__ import annotations

import math

from ..buffers.layout import FLAT, ROWS, FlatLayout, alignment, is_fixed
from ..buffers.records import ParamRecord, group_records


ROWS_EXTRA_PADDING = 0.01
"""The default placement keeps a parameter ``"rows"`` while whole rows pad
its buffer by at most this fraction of the buffer's elements (or one
alignment unit per rank, for small buffers) beyond what ``"flat"`` pads."""


def flatten_costly_rows(records: list[ParamRecord], candidates: list[ParamRecord],
                        world_size: int) -> list[ParamRecord]:
    """The default placement's rule: ``candidates`` (``"rows"`` by default,
    not by the user's choice) stay ``"rows"`` unless their buffer would pad
    more than :data:`ROWS_EXTRA_PADDING` beyond ``"flat"`` (rows of
    unrelated sizes, or few wide rows, grow every chunk); then the widest
    become ``"flat"``, widest first, until the padding fits. Returns the
    parameters made ``"flat"``."""
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
"""How much larger than FSDP2's largest piece of a unit's trainable
parameter a rank's largest one may be, on a CPU mesh, before
:func:`split_whole_pieces` gives parameters buffers of their own (each one
more all-gather and reduce-scatter per step, so only where a temporary of
the optimizer's shrinks by more than this)."""


def largest_share_bytes(record: ParamRecord, world_size: int) -> int:
    """The largest piece of ``record``'s parameter a rank holds when it is
    dealt by rows over ``world_size`` ranks (``torch.chunk``: FSDP2's
    ``Shard(0)``), in bytes."""
    shape = record.shape
    rows = -(-shape[0] // world_size) if shape else 1
    return rows * math.prod(shape[1:]) * record.param.dtype.itemsize


def split_whole_pieces(records: list[ParamRecord], candidates: list[ParamRecord],
                       world_size: int) -> list[ParamRecord]:
    """The default placement's rule on a CPU mesh: where a rank would hold
    a piece of one of ``candidates`` (placed by default, trainable, not
    tensor-parallel, on the unit's mesh) larger than the unit's largest
    ``Shard(0)`` piece (:func:`largest_share_bytes`) plus
    :data:`HOST_PIECE_SLACK_BYTES`, candidates get a buffer of their own,
    largest piece first, until no piece exceeds that ``Shard(0)`` piece.

    Why: rank boundaries fall where parameter sizes put them, so a
    parameter about a rank's share in size can sit whole on one rank; torch's
    CPU optimizers (no ``foreach``) make temporaries the size of each piece,
    so their peak follows the largest piece. On CUDA (``foreach``) the
    layout does not change the peak, so the rule is not applied there nor
    under CPU offload from CUDA (each buffer is one more collective).

    Post-condition: either nothing was split and every candidate's largest
    piece is at most the unit's largest ``Shard(0)`` piece plus
    :data:`HOST_PIECE_SLACK_BYTES`, or every candidate's largest piece is
    at most that ``Shard(0)`` piece or what it would be alone in a buffer
    (chunks are whole alignment units: two elements stay on one rank).
    Returns the parameters given a buffer of their own."""
    trainable = [r for r in records if r.param.requires_grad and r.group is None]
    movable = [r for r in candidates if r.param.requires_grad and r.group is None
               and r.tp is None and r.shape and not is_fixed(r.placement)]
    if not movable:
        return []
    bound = max(largest_share_bytes(r, world_size) for r in trainable)
    alone = {id(r): _largest_pieces([r], world_size)[id(r)] for r in movable}
    slack = HOST_PIECE_SLACK_BYTES
    split: list[ParamRecord] = []
    while True:
        pieces = _largest_pieces(records, world_size)
        over = [r for r in movable if not r.own_buffer and pieces.get(id(r), 0) > bound + slack
                and alone[id(r)] < pieces[id(r)]]
        if not over:
            return split
        record = max(over, key=lambda r: pieces[id(r)])
        record.own_buffer = True
        split.append(record)
        slack = 0


def _largest_pieces(records: list[ParamRecord], world_size: int) -> dict[int, int]:
    """Per record of a stream buffer (by id), the largest piece of it one
    rank holds, in bytes, with the records' buffers as they are grouped now
    (a single record: alone in a buffer)."""
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
