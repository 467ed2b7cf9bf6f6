"""Policies: mixed precision, CPU offload and quantized communication
(``fully_shard``'s arguments) and prefetching (``set_prefetch_policy``).
Frozen dataclasses: one object may be shared by many units.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """How a unit computes and communicates in lower precision. Sharded
    parameters and gradients keep the parameters' dtype; only the unsharded
    copy, the collectives and the compute change. The first four fields are
    FSDP2's, in its order; the others are keyword-only.

    Attributes:
        param_dtype: dtype of the unsharded parameters and the all-gather.
            ``None``: no cast. Floating point only.
        reduce_dtype: dtype gradients are reduced and accumulated in without
            sync. ``None``: ``param_dtype`` if set, else the parameter's (with
            ``reduce_follows_grad_dtype``, always the parameter's).
        output_dtype: cast floating-point forward outputs. ``None``: no cast.
        cast_forward_inputs: cast floating-point inputs to ``param_dtype``.
        reduce_comm_dtype: a narrower dtype the reduce-scatter moves (cast
            just before it, widened before division and accumulation).
            ``None``: ``reduce_dtype``.
        buffer_dtype: dtype the unit's floating-point module buffers are
            converted to at creation. ``None``: keep.
        param_dtype_override_fn: torch 2.15's: called once per parameter;
            returning its own dtype keeps it (norms in fp32), ``None`` or
            ``param_dtype`` casts; any other dtype raises ``ValueError``. Must
            agree on every rank.
        reduce_follows_grad_dtype: with ``reduce_dtype=None``, reduce in the
            parameter's dtype (torch 2.15's meaning). Default ``False``."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    _: KW_ONLY
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
    """No offloading (FSDP2's base class; the same as ``None``)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep the sharded parameters, gradients and optimizer state on the CPU,
    copied to the compute device before each all-gather and back after each
    reduce-scatter (no effect on a CPU mesh).

    Attributes:
        pin_memory: pin the CPU shards (with CUDA) for asynchronous copies."""

    pin_memory: bool = True


@dataclass(frozen=True)
class CommPolicy:
    """Block-quantized collectives (opt-in, per unit; ZeRO++'s qwZ and qgZ):
    sharded parameters and gradients stay exact; what the collectives move
    is quantized with one fp32 scale per ``block_size`` elements
    (``docs/performance.md``).

    Attributes:
        all_gather: code dtype of the all-gather, ``torch.int8`` or
            ``torch.float8_e4m3fn``; every rank decodes the same values, its
            own included. ``None``: exact.
        reduce_scatter: code dtype of the gradient reduction (an all-to-all,
            summed in fp32). ``None``: exact.
        block_size: elements per scale, a multiple of 4.

    Applies to floating-point buffers over more than one rank; the regather
    of a ``reshard_after_forward=k`` group and the replicas' all-reduce stay
    exact."""

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
        forward: before a unit's forward, all-gather the unit that ran after
            it in the previous forward.
        backward: when a unit's backward starts, all-gather the unit that ran
            before it in forward.
        max_inflight_all_gathers: all-gathers issued and not yet waited (the
            current unit's included); backward allows one more unsharded unit.
        max_pending_reduces: reduce-scatters in flight; the oldest is waited
            when a new one is issued.
        retain_staging: CPU only: keep the staging pool's memory between
            iterations (``False``: released at the end of each).
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
