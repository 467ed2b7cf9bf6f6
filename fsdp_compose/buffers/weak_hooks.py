"""Hooks that autograd stores in C++ and that must not keep their owner alive: a strong reference
back from a C++ hook list is a cycle the garbage collector cannot see.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional


def called_weakly(fn: Callable[[Any], Any],
                   bound: Optional[Callable[[], Any]] = None) -> Callable[[Any], Any]:
    """``fn`` (a bound method, held weakly), called with the same argument while its object lives
    and the argument is not ``None``; with ``bound`` (a weak reference), called with
    ``bound()`` instead. One Python call per hook (``WeakMethod`` adds one)."""
    owner = getattr(fn, "__self__", None)
    ref, function = (weakref.ref(owner), getattr(fn, "__func__")) if owner is not None else \
        ((lambda: _NO_OWNER), (lambda _owner, arg: fn(arg)))

    def call(arg):
        target = ref()
        if bound is not None:
            arg = bound()
        if target is None or arg is None:
            return None
        return function(target, arg)

    return call


_NO_OWNER = object()
