"""Policies: mixed precision, CPU offload and quantized communication
(``fully_shard``'s arguments) and prefetching (``set_prefetch_policy`` on
the root).

Frozen dataclasses, so one policy object can be shared by many units.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """How a unit computes and communicates in lower precision.

    The sharded parameters (the optimizer's master copy) and the sharded
    gradients always stay in the parameters' own dtype; only the unsharded
    working copy, the collectives and the compute change.

    The first four fields are torch FSDP2's, in FSDP2's order, so a policy
    written for ``torch.distributed.fsdp.MixedPrecisionPolicy`` means the
    same here, positionally too; the fields only fsdp_compose has are
    keyword-only (a fifth positional argument raises ``TypeError``).

    Attributes:
        param_dtype: dtype of the unsharded parameters and of the all-gather
            (the local shard is cast once, before the all-gather, so the
            collective moves half the bytes for bf16/fp16). ``None``: no cast.
            Applies to floating-point parameters only.
        reduce_dtype: dtype gradients are reduced and accumulated in: the
            reduce-scatter and the sum of micro-batches accumulated without
            sync. ``None``: ``param_dtype`` when set (the dtype backward
            computes the gradient in), else the parameter's dtype; with
            ``reduce_follows_grad_dtype=True``, the parameter's dtype. The
            reduced shard is accumulated into the full-precision sharded
            gradient. (torch's own ``MixedPrecisionPolicy`` given to
            ``fully_shard`` means what it means under that torch's
            ``fully_shard``: on torch >= 2.15 ``reduce_dtype=None`` follows
            the parameter's dtype, e.g. fp32 for fp32 parameters with
            ``param_dtype=torch.bfloat16``; before 2.15, ``param_dtype``.)
        output_dtype: cast floating-point outputs of the unit's forward to
            this dtype. ``None``: no cast.
        cast_forward_inputs: cast floating-point tensor inputs of the unit's
            forward to ``param_dtype`` (if set).
        reduce_comm_dtype: (keyword-only) dtype the reduce-scatter
            *communicates* in, when it should be narrower than
            ``reduce_dtype`` (opt-in). E.g. ``param_dtype=bf16,
            reduce_dtype=fp32, reduce_comm_dtype=bf16``: micro-batches
            without sync are summed in an fp32 buffer, the flat gradient is
            cast to bf16 just before the collective (half the bytes), and the
            reduced bf16 shard is widened to fp32 before the division by the
            world size and the accumulation into the fp32 sharded gradient.
            ``None``: ``reduce_dtype``. Over one rank nothing is
            communicated and no cast is made.
        buffer_dtype: (keyword-only) dtype that the unit's floating-point
            module buffers are converted to, in place, when the unit is
            created. ``None``: keep.
        param_dtype_override_fn: (keyword-only, torch 2.15's field) called
            once per parameter at ``fully_shard``: returning the
            parameter's own dtype keeps it in that dtype (all-gathered and
            computed in it, e.g. norms in fp32 while the rest computes in
            bf16); ``None`` or ``param_dtype``: ``param_dtype``. Any other
            dtype raises ``ValueError`` (as torch). Must return the same on
            every rank. Inputs are still cast to ``param_dtype``.
        reduce_follows_grad_dtype: (keyword-only) with ``reduce_dtype=None``,
            reduce in the parameter's dtype instead of ``param_dtype``
            (torch 2.15's meaning of ``reduce_dtype=None``; what a torch
            >= 2.15 policy converts to). Default ``False``: fsdp_compose's
            meaning, torch <= 2.14's.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    _: KW_ONLY  # fsdp_compose's own fields: keyword-only, after FSDP2's four
    reduce_comm_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    param_dtype_override_fn: Optional[Callable[[nn.Parameter], Optional[torch.dtype]]] = None
    reduce_follows_grad_dtype: bool = False

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "reduce_comm_dtype", "output_dtype",
                     "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy.{name} must be a floating-point "
                                 f"torch.dtype or None, got {value!r}")


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: what FSDP2's base class means as ``offload_policy``
    (the same as ``None``); :class:`CPUOffloadPolicy` is the one that offloads."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep the sharded parameters and gradients (and so the optimizer step
    and its state) on the CPU; each unit's shard is copied to the compute
    device just before its all-gather and the reduced gradient shard copied
    back after the reduce-scatter. On a CPU mesh this changes nothing.

    Same field, order and default as torch FSDP2's ``CPUOffloadPolicy``.

    Attributes:
        pin_memory: pin the CPU shards (when CUDA is available) so the copies
            can be asynchronous.
    """

    pin_memory: bool = True


@dataclass(frozen=True)
class CommPolicy:
    """Fewer bytes on the wire: block-quantized collectives (opt-in, per
    unit; ZeRO++'s qwZ and qgZ). The sharded parameters (the optimizer's
    master copy) and the sharded gradients stay exact; only what the
    collectives move is quantized, block by block with one fp32 scale per
    ``block_size`` elements (``docs/performance.md``, "Quantized
    collectives", for the error and when it pays).

    Attributes:
        all_gather: code dtype of the parameters' all-gather: ``torch.int8``
            or ``torch.float8_e4m3fn`` (~1 byte per element plus 4 per
            block, instead of 4 for fp32 or 2 for bf16). Every rank decodes
            the same values, its own shard's included, into the unsharded
            buffer (``param_dtype`` under mixed precision), so forward and
            backward see the same quantized parameters on every rank.
            ``None``: the exact values.
        reduce_scatter: code dtype of the gradients' reduction (same
            choices): each rank quantizes each destination's chunk of its
            flat gradient, an all-to-all delivers them, and each rank sums
            the decoded chunks in fp32. ``None``: the exact reduce-scatter.
        block_size: elements per scale (a multiple of 4; smaller blocks
            are more accurate and cost ``4 / block_size`` bytes more per
            element).

    Applies to floating-point buffers sharded over more than one rank; the
    all-gather over a ``reshard_after_forward=k`` group (which regathers
    values already quantized in forward) and the all-reduce across
    replicas (hybrid sharding) stay exact.
    """

    all_gather: Optional[torch.dtype] = None
    reduce_scatter: Optional[torch.dtype] = None
    block_size: int = 256

    def __post_init__(self) -> None:
        allowed = [torch.int8] + ([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])
        for name in ("all_gather", "reduce_scatter"):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ValueError(f"CommPolicy.{name} must be one of {allowed} or None, "
                                 f"got {value!r}")
        if self.block_size <= 0 or self.block_size % 4:
            raise ValueError(f"CommPolicy.block_size must be a positive multiple of 4, "
                             f"got {self.block_size}")


@dataclass(frozen=True)
class PrefetchPolicy:
    """How far communication runs ahead of computation.

    Attributes:
        forward: before a unit's forward, issue the all-gather of the unit
            that ran after it in the previous iteration's forward.
        backward: when a unit's backward starts, issue the all-gather of the
            unit that ran before it in this iteration's forward (before this
            unit's own reduce-scatter).
        max_inflight_all_gathers: at most this many all-gathers issued and
            not yet waited on (the current unit's included). Unsharded units
            beyond the root: at most this many in forward; in backward one
            more, the unit whose gradient is still being accumulated.
        max_pending_reduces: at most this many reduce-scatters in flight;
            the oldest is waited on when a new one is issued (each holds a
            full flat gradient alive until it completes).
        retain_staging: CPU only: keep the staging pool's memory (the
            largest unsharded working set) between iterations, so that the
            next forward faults in no pages for it; ``False`` (default)
            releases it at the end of each iteration, so nothing unsharded
            is held between steps (see ``buffers/staging.py``).
    """

    forward: bool = True
    backward: bool = True
    max_inflight_all_gathers: int = 2
    max_pending_reduces: int = 1
    retain_staging: bool = False

    def __post_init__(self) -> None:
        if self.max_inflight_all_gathers < 1 or self.max_pending_reduces < 1:
            raise ValueError("PrefetchPolicy limits must be >= 1, got "
                             f"{self.max_inflight_all_gathers} and {self.max_pending_reduces}")
