"""Keeping ``torch.compile`` out of the hooks: they resize storages, run
collectives and swap module attributes, which dynamo must not trace, so
under compilation each is a graph break run eagerly. Outside compilation
the hook is called directly: no import of ``torch._dynamo``.
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
        # one call to ask (is_compiling makes two; this runs twice per unit and step)
        if torch.compiler.is_dynamo_compiling():
            return dynamo_disable(fn, recursive=True)(*args, **kwargs)
        return fn(*args, **kwargs)

    return hook  # type: ignore[return-value]
