"""Named ranges in profiler traces: ``fsdp_compose::<moment> <subject>``.

Each hook moment and each collective's issue and wait is a
``record_function`` range while a torch profiler records, so a trace shows
which unit a copy or collective belongs to (ranges nest). With no profiler
recording, :func:`profiled` returns one shared do-nothing context: no string
is built, no op dispatched.
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
    """The range ``fsdp_compose::<moment> <subject>`` while a profiler
    records, else a shared no-op context. A callable ``subject`` is called
    only while a profiler records (a name that costs work to build)."""
    if not profiler_active():
        return _NOTHING
    if callable(subject):
        subject = subject()
    return record_function(f"{PREFIX}{moment} {subject}" if subject else PREFIX + moment)


def call_profiled(moment: str, subject: str, fn: Callable[..., _T], *args: object) -> _T:
    """``fn(*args)`` inside :func:`profiled` ``(moment, subject)``: the same
    range, for the hooks that run once per unit and step (no context
    manager is entered while no profiler records)."""
    if not profiler_active():
        return fn(*args)
    with record_function(f"{PREFIX}{moment} {subject}" if subject else PREFIX + moment):
        return fn(*args)
