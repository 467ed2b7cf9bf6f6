"""The user's class name of a module, also once ``fully_shard`` swapped its
class for the ``Sharded...`` subclass (``sharded_module.sharded_class``,
which records the original as :data:`USER_CLASS_ATTR`). Every message and
report names a unit by this one name."""

from __future__ import annotations

import torch.nn as nn

USER_CLASS_ATTR = "_fsdp_compose_user_class"
"""Attribute of each dynamic ``Sharded...`` class: the class it extends."""


def user_class_name(module: nn.Module) -> str:
    """``type(module).__name__``, or the original class's for an annotated module."""
    cls = type(module)
    return cls.__dict__.get(USER_CLASS_ATTR, cls).__name__
