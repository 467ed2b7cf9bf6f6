"""The Trainer's ``bf16`` / ``fp16`` flags under fsdp_compose: the units'
``MixedPrecisionPolicy`` (compute and all-gather in the flag's dtype,
reduce in fp32), as accelerate's FSDP2 plugin, instead of autocast. An
annotated model's own ``mp_policy`` wins; a flag asking another dtype is
refused.
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
    if dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def describe(policy: Optional[MixedPrecisionPolicy]) -> str:
    if policy is None:
        return "full precision (no mp_policy)"
    return (f"MixedPrecisionPolicy(param_dtype={policy.param_dtype}, "
            f"reduce_dtype={policy.reduce_dtype})")


def check_agrees(trainer: str, model: nn.Module, dtype: Optional[torch.dtype]) -> None:
    """``ValueError`` when a flag asks for ``dtype`` and a unit computes in another."""
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
