"""What one flat buffer holds and in which dtypes: parameter records, the
grouping of a unit's parameters into buffers, and the dtype rules.

Pure functions of shapes, dtypes and policies, shared by ``fully_shard``
and the memory planner so the two cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn as nn

from ..comm.groups import ShardGroup
from ..comm.quantized import BlockQuantizer
from ..policies import CommPolicy, CPUOffloadPolicy, MixedPrecisionPolicy
from .layout import FLAT, FlatLayout, Placement, alignment, is_fixed
from .tensor_parallel import TensorParallelSpec


@dataclass
class ParamRecord:
    """One original parameter managed by a flat buffer.

    Attributes:
        param: the original ``nn.Parameter`` (identity kept).
        slots: every ``(module, attribute)`` registering it in the unit.
        fqn: its name relative to the outermost annotated module so far.
        shape: its original shape (TP-local for a tensor-parallel parameter).
        tp: how to present a tensor-parallel parameter as a ``DTensor`` again.
        placement: where rank boundaries may fall in it (``layout.py``).
        group: the ranks its buffer shards over when not its unit's.
        own_buffer: it has a flat buffer of its own.
        keeps_dtype: computed in its own dtype, not ``param_dtype``."""

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
    """Precision and placement of one flat buffer (:func:`buffer_policy`).

    Attributes:
        compute_dtype: of the unsharded buffer and the all-gather (``None``:
            the parameters').
        reduce_dtype: of the reduction and unsynced accumulation (``None``:
            ``compute_dtype``).
        reduce_comm_dtype: what the reduce-scatter moves (``None``:
            ``reduce_dtype``).
        offload_to_cpu, pin_memory: keep (pinned) shards and gradients on the CPU.
        gather_quantizer, reduce_quantizer: wire formats (``None``: exact)."""

    compute_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    offload_to_cpu: bool = False
    pin_memory: bool = False
    reduce_comm_dtype: Optional[torch.dtype] = None
    gather_quantizer: Optional[BlockQuantizer] = None
    reduce_quantizer: Optional[BlockQuantizer] = None
    reduce_follows_param: bool = False
    """``reduce_dtype=None`` reduces in the parameters' dtype
    (``MixedPrecisionPolicy.reduce_follows_grad_dtype``)."""


class BufferDtypes(NamedTuple):
    """The dtypes of one flat buffer, resolved: ``param`` (shards and sharded
    gradients), ``compute`` (unsharded buffer, all-gather), ``reduce``
    (reduction, unsynced accumulation), ``reduce_comm`` (what the
    reduce-scatter moves)."""

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
    """The policy of one group's buffer: parameters that keep their dtype are
    gathered and computed in it."""
    return policy._replace(compute_dtype=None) if records[0].keeps_dtype else policy


def apply_dtype_overrides(records: list[ParamRecord], mp_policy: Optional[MixedPrecisionPolicy]
                          ) -> None:
    """Call ``mp_policy.param_dtype_override_fn`` once per parameter and mark
    those it keeps in their own dtype; ``ValueError`` naming the parameter
    for any dtype but ``None``, ``param_dtype`` and its own."""
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
    """The dtypes of a buffer of ``dtype`` parameters; mixed precision applies
    to floating-point buffers only."""
    floating = dtype.is_floating_point
    compute = (policy.compute_dtype if floating else None) or dtype
    fallback = dtype if policy.reduce_follows_param else compute
    reduce = (policy.reduce_dtype if floating else None) or fallback
    reduce_comm = (policy.reduce_comm_dtype if floating else None) or reduce
    return BufferDtypes(dtype, compute, reduce, reduce_comm)


def is_aliased(world_size: int, dtypes: BufferDtypes, stored_where_computed: bool) -> bool:
    """The unsharded buffer *is* the shard's storage: one rank, same dtype,
    shards on the compute device."""
    return world_size == 1 and dtypes.compute == dtypes.param and stored_where_computed


def group_records(records: list[ParamRecord]) -> list[list[ParamRecord]]:
    """One group (one flat buffer) per ``(dtype, requires_grad, fixed,
    shard group, own buffer, keeps its dtype)``, in order of first
    appearance: frozen parameters never cost gradient memory, pinned and
    stream placements never share a layout, and the rest get buffers of
    their own."""
    groups: dict[tuple[torch.dtype, bool, bool, int, int, bool], list[ParamRecord]] = {}
    for r in records:
        key = (r.param.dtype, r.param.requires_grad, is_fixed(r.placement), id(r.group),
               id(r) if r.own_buffer else 0, r.keeps_dtype)
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def buffer_layout(records: list[ParamRecord], world_size: int, policy: BufferPolicy) -> FlatLayout:
    """The layout of one group's flat buffer, chunks 16-byte aligned in every
    dtype it is held in (and in 2-byte dtypes, so ``module.to(bfloat16)``
    keeps them so)."""
    dtypes = resolve_dtypes(records[0].param.dtype, policy_for(records, policy))
    align = alignment(dtypes.param.itemsize, dtypes.compute.itemsize,
                      dtypes.reduce_comm.itemsize, 2)
    return FlatLayout([r.shape for r in records], world_size,
                      [r.placement for r in records], align)
