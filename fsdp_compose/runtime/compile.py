"""Keeping ``torch.compile`` out of the hooks.

``module.compile()`` (or ``torch.compile(module)``) traces ``Module.__call__``
including its forward hooks. Ours resize storages, run collectives and swap
module attributes, which dynamo must not put in a graph: under compilation
each hook is a graph break and runs eagerly. Outside compilation the hook is
called directly, so using ``fully_shard`` without ``torch.compile`` never
imports ``torch._dynamo``.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

from .._torch_private import dynamo_disable

_F = TypeVar("_F", bound=Callable)


def run_eagerly(fn: _F) -> _F:
    """``fn``, never traced by dynamo (a graph break that runs it eagerly)."""

    @functools.wraps(fn)
    def hook(*args, **kwargs):
        # dynamo reads True here while it traces (one call to ask, against
        # is_compiling's two: this runs twice per unit and step)
        if torch.compiler.is_dynamo_compiling():
            return dynamo_disable(fn, recursive=True)(*args, **kwargs)
        return fn(*args, **kwargs)

    return hook  # type: ignore[return-value]
