"""What one flat buffer holds and in which dtypes: parameter records, the
grouping of a unit's parameters into buffers, and the dtype rules.

Pure functions of shapes, dtypes and policies (no process group): the same
code serves ``fully_shard`` and the memory planner (``tools/planner``), so
the two cannot disagree on which buffers a unit gets or what they weigh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn as nn

from ..comm.groups import ShardGroup
from ..comm.quantized import BlockQuantizer
from ..policies import CommPolicy, CPUOffloadPolicy, MixedPrecisionPolicy
from .layout import FLAT, ROWS, FlatLayout, Placement, alignment, is_fixed
from .tensor_parallel import TensorParallelSpec


@dataclass
class ParamRecord:
    """One original parameter managed by a flat buffer.

    Attributes:
        param: the original ``nn.Parameter`` (identity kept for the user).
        slots: every ``(module, attribute name)`` that registers it within
            the unit (more than one when a parameter is shared inside a unit).
        fqn: its fully-qualified name relative to the outermost annotated
            module seen so far (updated when an ancestor is annotated).
        shape: its original shape (the TP-local shape for a tensor-parallel
            parameter: what the flat layout holds).
        tp: for a tensor-parallel parameter (a ``DTensor`` before
            ``fully_shard``), what forward and state dicts need to present
            it as one again (see ``tensor_parallel.py``); else ``None``.
        placement: where rank boundaries may fall in it (``layout.py``):
            ``"flat"``, ``"rows"``, ``"owned"``, ``Blocks(n)`` or ``ShardDim(d)``.
        group: the ranks its buffer shards over when not its unit's
            (``shard_placement_fn`` returned another mesh); ``None``: the
            unit's.
        own_buffer: it has a flat buffer of its own
            (:func:`split_whole_pieces`, the default placement's rule on a
            CPU mesh).
        keeps_dtype: it is computed in its own dtype, not the policy's
            ``param_dtype`` (:func:`apply_dtype_overrides`).
    """

    param: nn.Parameter
    slots: list[tuple[nn.Module, str]]
    fqn: str
    shape: torch.Size
    tp: Optional[TensorParallelSpec] = None
    placement: Placement = FLAT
    group: Optional[ShardGroup] = None
    own_buffer: bool = False
    keeps_dtype: bool = False


class BufferPolicy(NamedTuple):
    """Precision and placement of one flat buffer (derived from the unit's
    ``MixedPrecisionPolicy`` and ``CPUOffloadPolicy`` by :func:`buffer_policy`).

    Attributes:
        compute_dtype: dtype of the unsharded buffer and the all-gather
            (``None``: the parameters' dtype).
        reduce_dtype: dtype of the reduction and of accumulation without
            sync (``None``: ``compute_dtype``).
        reduce_comm_dtype: dtype the reduce-scatter communicates in
            (``None``: ``reduce_dtype``).
        offload_to_cpu: keep ``sharded``/``sharded_grad`` on the CPU.
        pin_memory: pin them (only meaningful with CUDA).
        gather_quantizer: the wire format of the all-gather (``CommPolicy``;
            ``None``: exact). Floating-point buffers only.
        reduce_quantizer: the wire format of the gradient reduction.
    """

    compute_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    offload_to_cpu: bool = False
    pin_memory: bool = False
    reduce_comm_dtype: Optional[torch.dtype] = None
    gather_quantizer: Optional[BlockQuantizer] = None
    reduce_quantizer: Optional[BlockQuantizer] = None
    reduce_follows_param: bool = False
    """``reduce_dtype=None`` reduces in the parameters' dtype, not the
    compute dtype (``MixedPrecisionPolicy.reduce_follows_grad_dtype``)."""


class BufferDtypes(NamedTuple):
    """The dtypes of one flat buffer, resolved (no ``None``).

    Attributes:
        param: the parameters' own dtype: shards and sharded gradients.
        compute: the unsharded buffer and the all-gather.
        reduce: the reduction and accumulation without sync.
        reduce_comm: what the reduce-scatter moves (narrower than
            ``reduce`` only with ``reduce_comm_dtype``).
    """

    param: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype
    reduce_comm: torch.dtype


def buffer_policy(mp_policy: MixedPrecisionPolicy, offload_policy: Optional[CPUOffloadPolicy],
                  cuda_available: bool, comm_policy: Optional[CommPolicy] = None) -> BufferPolicy:
    """A unit's policies, as its flat buffers see them."""
    comm = comm_policy or CommPolicy()
    return BufferPolicy(
        compute_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype,
        reduce_comm_dtype=mp_policy.reduce_comm_dtype, offload_to_cpu=offload_policy is not None,
        pin_memory=offload_policy is not None and offload_policy.pin_memory and cuda_available,
        gather_quantizer=_quantizer(comm.all_gather, comm.block_size),
        reduce_quantizer=_quantizer(comm.reduce_scatter, comm.block_size),
        reduce_follows_param=mp_policy.reduce_follows_grad_dtype)


def policy_for(records: list[ParamRecord], policy: BufferPolicy) -> BufferPolicy:
    """The policy of the buffer of ``records`` (one group of
    :func:`group_records`): parameters that keep their dtype are gathered
    and computed in it."""
    return policy._replace(compute_dtype=None) if records[0].keeps_dtype else policy


def apply_dtype_overrides(records: list[ParamRecord], mp_policy: Optional[MixedPrecisionPolicy]
                          ) -> None:
    """Call ``mp_policy.param_dtype_override_fn`` once per floating-point
    parameter and mark those it keeps in their own dtype (``keeps_dtype``).
    ``ValueError`` naming the parameter for any dtype but ``None``,
    ``param_dtype`` and the parameter's own (as torch's ``fully_shard``)."""
    override = mp_policy.param_dtype_override_fn if mp_policy is not None else None
    if override is None or mp_policy is None:
        return
    param_dtype = mp_policy.param_dtype
    for record in records:
        dtype = override(record.param)
        if dtype is None:
            continue
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"param_dtype_override_fn must return a torch.dtype or None, got "
                             f"{type(dtype).__name__} for parameter '{record.fqn}'")
        if dtype not in (param_dtype, record.param.dtype):
            raise ValueError(
                f"param_dtype_override_fn returned {dtype} for parameter '{record.fqn}' "
                f"({record.param.dtype}); it may return None, param_dtype ({param_dtype}) or "
                "the parameter's own dtype (to keep it in that dtype).")
        record.keeps_dtype = param_dtype is not None and dtype == record.param.dtype != param_dtype \
            and record.param.dtype.is_floating_point


def _quantizer(code_dtype: Optional[torch.dtype], block: int) -> Optional[BlockQuantizer]:
    return None if code_dtype is None else BlockQuantizer(code_dtype, block)


def resolve_dtypes(dtype: torch.dtype, policy: BufferPolicy) -> BufferDtypes:
    """The dtypes of a buffer of ``dtype`` parameters under ``policy``;
    mixed precision applies to floating-point buffers only."""
    floating = dtype.is_floating_point
    compute = (policy.compute_dtype if floating else None) or dtype
    fallback = dtype if policy.reduce_follows_param else compute
    reduce = (policy.reduce_dtype if floating else None) or fallback
    reduce_comm = (policy.reduce_comm_dtype if floating else None) or reduce
    return BufferDtypes(dtype, compute, reduce, reduce_comm)


def is_aliased(world_size: int, dtypes: BufferDtypes, stored_where_computed: bool) -> bool:
    """One rank, same dtype, shards on the compute device: the unsharded
    buffer *is* the shard's storage (nothing is ever gathered or freed)."""
    return world_size == 1 and dtypes.compute == dtypes.param and stored_where_computed


def group_records(records: list[ParamRecord]) -> list[list[ParamRecord]]:
    """One group (one flat buffer) per ``(dtype, requires_grad, fixed,
    shard group, own buffer, keeps its dtype)``, in order of first
    appearance, so frozen parameters never cost gradient memory or
    reduce-scatter volume; parameters pinned to ranks (``"owned"``,
    ``ShardDim``) and the others (a stream of flat/rows/blocks) never share
    a layout (``layout.py``); parameters on another mesh than their unit's,
    those marked ``own_buffer`` and those ``param_dtype_override_fn`` keeps
    in their own dtype have buffers of their own."""
    groups: dict[tuple[torch.dtype, bool, bool, int, int, bool], list[ParamRecord]] = {}
    for r in records:
        key = (r.param.dtype, r.param.requires_grad, is_fixed(r.placement), id(r.group),
               id(r) if r.own_buffer else 0, r.keeps_dtype)
        groups.setdefault(key, []).append(r)
    return list(groups.values())


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


def buffer_layout(records: list[ParamRecord], world_size: int, policy: BufferPolicy) -> FlatLayout:
    """The layout of one group's flat buffer: its placements, with chunks
    16-byte aligned in the shard's, the gathered and the reduced dtype (and
    in 2-byte dtypes, so that ``module.to(torch.bfloat16)`` keeps them so)."""
    dtypes = resolve_dtypes(records[0].param.dtype, policy_for(records, policy))
    align = alignment(dtypes.param.itemsize, dtypes.compute.itemsize,
                      dtypes.reduce_comm.itemsize, 2)
    return FlatLayout([r.shape for r in records], world_size,
                      [r.placement for r in records], align)
