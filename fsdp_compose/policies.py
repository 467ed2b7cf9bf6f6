"""Policies passed to ``fully_shard``: mixed precision and CPU offload.

Frozen dataclasses, so one policy object can be shared by many units.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Optional

import torch


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
            sync. ``None``: the gradient's own dtype (``param_dtype`` when
            set). The reduced shard is accumulated into the full-precision
            sharded gradient.
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
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    _: KW_ONLY  # fsdp_compose's own fields: keyword-only, after FSDP2's four
    reduce_comm_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "reduce_comm_dtype", "output_dtype",
                     "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy.{name} must be a floating-point "
                                 f"torch.dtype or None, got {value!r}")


@dataclass(frozen=True)
class CPUOffloadPolicy:
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
