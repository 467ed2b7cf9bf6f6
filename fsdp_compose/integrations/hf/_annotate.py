"""The model the trainer got, annotated as accelerate's FSDP2 plugin would
shard it, from ``fsdp_config``'s keys (``transformer_layer_cls_to_wrap``,
else ``_no_split_modules``; ``reshard_after_forward``, ``cpu_offload``,
``activation_checkpointing``). Other keys are refused, but ``version`` and
``state_dict_type``, which choose nothing here.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import torch.nn as nn

from ...api import fully_shard
from ...policies import CPUOffloadPolicy, MixedPrecisionPolicy

LAYER_KEY = "transformer_layer_cls_to_wrap"
_USED = (LAYER_KEY, "reshard_after_forward", "cpu_offload", "activation_checkpointing")
_NOTHING_TO_CHOOSE = ("version", "state_dict_type")
_DEFAULT_WRAP = "TRANSFORMER_BASED_WRAP"


def fsdp_config(args: Any) -> dict[str, Any]:
    """``args.fsdp_config`` as a dict with accelerate's spellings; raises
    ``ValueError`` naming a key fsdp_compose does not give its meaning."""
    raw = getattr(args, "fsdp_config", None) or {}
    if isinstance(raw, str):
        with open(raw, encoding="utf-8") as f:
            raw = json.load(f)
    config = {key[len("fsdp_"):] if key.startswith("fsdp_") else key: value
              for key, value in raw.items()}
    if isinstance(config.get(LAYER_KEY), str):
        config[LAYER_KEY] = [config[LAYER_KEY]]
    defaults = {"auto_wrap_policy": _DEFAULT_WRAP, "min_num_params": 0, "xla": False,
                "xla_fsdp_v2": False, "xla_fsdp_grad_ckpt": False}
    unknown = sorted(key for key in config if key not in _USED + _NOTHING_TO_CHOOSE
                     and not (key in defaults and config[key] == defaults[key]))
    if unknown:
        raise ValueError(
            f"fsdp_config has {', '.join(repr(k) for k in unknown)}, which fsdp_compose does not "
            f"apply. It reads {', '.join(_USED)}; remove the others (for another layout, annotate "
            "the model with fsdp_compose.fully_shard yourself and pass it annotated).")
    return config


def annotate(model: nn.Module, config: dict[str, Any],
             mp_policy: Optional[MixedPrecisionPolicy]) -> list[str]:
    """``fully_shard`` each module of the layer classes, then the root;
    returns the class names. ``ValueError`` when no layer class is known or
    one is not in the model."""
    names = list(config.get(LAYER_KEY) or _no_split_modules(model))
    if not names:
        raise ValueError(
            f"{type(model).__name__} names no layer class to shard (no _no_split_modules): pass "
            f"fsdp_config={{'{LAYER_KEY}': ['MyDecoderLayer']}} in the training arguments.")
    present = {type(m).__name__ for m in model.modules()}
    missing = [name for name in names if name not in present]
    if missing:
        raise ValueError(f"fsdp_config['{LAYER_KEY}'] names {missing}, which {type(model).__name__} "
                         f"does not contain; its module classes include {sorted(present)[:12]}.")
    wanted = set(names)
    layers = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
    if _true(config.get("activation_checkpointing")):
        from ..._torch_private import composable_checkpoint
        checkpoint = composable_checkpoint()
        for layer in layers:
            checkpoint(layer)
    kwargs: dict[str, Any] = {"mp_policy": mp_policy}
    if "reshard_after_forward" in config:
        kwargs["reshard_after_forward"] = _true(config["reshard_after_forward"])
    if _true(config.get("cpu_offload")):
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return names


def _no_split_modules(model: nn.Module) -> list[str]:
    """The layer classes transformers keeps whole (a PEFT model's base's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return sorted(getattr(base, "_no_split_modules", None) or [])


def _true(value: Any) -> bool:
    return str(value).lower() in ("true", "1", "yes")
