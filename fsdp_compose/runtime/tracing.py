"""What torch's tracers see of the hooks.

The profiler: ranges ``fsdp_compose::<moment> <subject>`` around each hook
and each collective's issue and wait; callers test ``profiler_active()``
first, so nothing here runs without one.

``torch.compile``: the hooks resize storages, run collectives and swap
module attributes, which dynamo must not trace, so each is a graph break
run eagerly (:func:`run_eagerly`).
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext
from typing import Callable, TypeVar, Union

import torch
from torch.autograd.profiler import record_function

from .._torch_private import dynamo_disable, profiler_active

PREFIX = "fsdp_compose::"
_NOTHING = nullcontext()
NO_RANGE: AbstractContextManager = _NOTHING
"""The range while no profiler records, for ``with profiled(...) if
profiler_active() else NO_RANGE``."""
_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable)


def profiled(moment: str, subject: Union[str, Callable[[], str]] = "") -> AbstractContextManager:
    """The range, else a shared no-op context; a callable ``subject`` is
    called only while a profiler records."""
    if not profiler_active():
        return _NOTHING
    if callable(subject):
        subject = subject()
    return record_function(f"{PREFIX}{moment} {subject}" if subject else PREFIX + moment)


def call_profiled(moment: str, subject: str, fn: Callable[..., _T], *args: object) -> _T:
    """``fn(*args)`` in the same range."""
    if not profiler_active():
        return fn(*args)
    with record_function(f"{PREFIX}{moment} {subject}" if subject else PREFIX + moment):
        return fn(*args)


def run_eagerly(fn: _F) -> _F:
    """``fn``, never traced by dynamo (a graph break that runs it eagerly)."""

    @functools.wraps(fn)
    def hook(*args, **kwargs):
        # one call (is_compiling makes two); this runs twice per unit and step
        if torch.compiler.is_dynamo_compiling():
            return dynamo_disable(fn, recursive=True)(*args, **kwargs)
        return fn(*args, **kwargs)

    return hook  # type: ignore[return-value]
