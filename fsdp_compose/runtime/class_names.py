"""The user's class name of a module, also after ``fully_shard`` swapped
its class for a ``Sharded...`` subclass: every message names a unit by it."""

from __future__ import annotations

import torch.nn as nn

USER_CLASS_ATTR = "_fsdp_compose_user_class"
"""Set by ``sharded_module.sharded_class``: the class it extends."""


def user_class_name(module: nn.Module) -> str:
    """``type(module).__name__``, or the original class's for an annotated module."""
    cls = type(module)
    return cls.__dict__.get(USER_CLASS_ATTR, cls).__name__
