"""Profiler ranges ``fsdp_compose::<moment> <subject>`` around each hook and
each collective's issue and wait, so a trace shows whose copy or collective
it is. With no profiler recording nothing is built or dispatched.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable, TypeVar, Union

from torch.autograd.profiler import record_function

from .._torch_private import profiler_active

PREFIX = "fsdp_compose::"
_NOTHING = nullcontext()
_T = TypeVar("_T")


def profiled(moment: str, subject: Union[str, Callable[[], str]] = "") -> AbstractContextManager:
    """The range, else a shared no-op context; a callable ``subject`` is
    called only while a profiler records."""
    if not profiler_active():
        return _NOTHING
    if callable(subject):
        subject = subject()
    return record_function(f"{PREFIX}{moment} {subject}" if subject else PREFIX + moment)


def call_profiled(moment: str, subject: str, fn: Callable[..., _T], *args: object) -> _T:
    """``fn(*args)`` in the same range, for hooks that run once per unit
    and step (no context manager without a profiler)."""
    if not profiler_active():
        return fn(*args)
    with record_function(f"{PREFIX}{moment} {subject}" if subject else PREFIX + moment):
        return fn(*args)
