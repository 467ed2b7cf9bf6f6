"""What the Trainer's ``bf16`` / ``fp16`` flags mean under fsdp_compose.

accelerate implements the flags by autocasting the model's forward while
preparing it, which the mixin skips (it hands the model over prepared).
Here a flag becomes the unit's ``MixedPrecisionPolicy``: compute and
all-gather in the flag's dtype, reduce gradients in fp32, the shards (the
optimizer's master copy) stay in the parameters' dtype, as accelerate's
FSDP2 plugin does with ``mixed_precision="bf16"``.

* An unannotated model: annotated with that policy (:func:`policy_for`).
* An annotated model: its units' ``mp_policy`` wins; a flag that asks for
  another compute dtype than the units' is refused naming both
  (:func:`check_agrees`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from ...policies import MixedPrecisionPolicy
from ...runtime.state import units_below


def flag_dtype(args: Any) -> Optional[torch.dtype]:
    """The compute dtype ``bf16=True`` / ``fp16=True`` ask for; ``None``: neither."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return None


def policy_for(dtype: Optional[torch.dtype]) -> Optional[MixedPrecisionPolicy]:
    """The policy a flag's dtype stands for (``None``: full precision)."""
    if dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def describe(policy: Optional[MixedPrecisionPolicy]) -> str:
    if policy is None:
        return "full precision (no mp_policy)"
    return (f"MixedPrecisionPolicy(param_dtype={policy.param_dtype}, "
            f"reduce_dtype={policy.reduce_dtype})")


def check_agrees(trainer: str, model: nn.Module, dtype: Optional[torch.dtype]) -> None:
    """Raises ``ValueError`` when a flag asks for ``dtype`` and a unit of the
    annotated ``model`` computes in another dtype (or in full precision)."""
    if dtype is None:
        return  # no flag: the units' mp_policy decides
    computes = {unit.settings.mp_policy.param_dtype for unit in units_below(model)}
    if computes == {dtype}:
        return
    flag = "bf16" if dtype == torch.bfloat16 else "fp16"
    theirs = ", ".join(sorted("full precision (no mp_policy)" if d is None else f"param_dtype={d}"
                              for d in computes))
    raise ValueError(
        f"{trainer}: the training arguments ask for {flag}=True ({dtype} compute), but the model "
        f"was annotated by fully_shard with {theirs}. Pick one: pass the model unannotated (the "
        f"trainer then annotates it with {describe(policy_for(dtype))}), annotate it with that "
        f"mp_policy yourself, or set {flag}=False to keep the units' precision.")
