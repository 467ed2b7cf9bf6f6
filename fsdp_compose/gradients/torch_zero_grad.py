"""torch's ``Optimizer.zero_grad`` gives back the memory of the sharded gradients it clears.

A buffer's last published gradient is kept for the next reduction ([Note:
the kept sharded gradient]) and given back once only the library holds it:
at the root's next pre-forward, or, once ``fully_shard`` ran
(:func:`install`), right after ``optimizer.zero_grad()`` clears ``.grad``,
as FSDP2 does. Values never change.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable

from torch.optim import Optimizer

from .._torch_private import lazy_dynamo_disable
from ..buffers.flat_grad import FlatGradient
from ..runtime.owners import any_owner, owner_of

__all__ = ["install", "release_cleared_gradients"]

_original: list[Callable[..., None]] = []

_GRADIENTS: "weakref.WeakKeyDictionary[Optimizer, tuple[int, tuple[weakref.ref[FlatGradient], ...]]]" = \
    weakref.WeakKeyDictionary()
"""Per optimizer: its parameter count when last looked at, and (weakly) the gradient of each
buffer holding one of its parameters."""


def install() -> None:
    """Replace ``Optimizer.zero_grad`` (once per process)."""
    if _original:
        return
    original = Optimizer.zero_grad

    @functools.wraps(original)
    def zero_grad(self: Optimizer, set_to_none: bool = True) -> None:
        original(self, set_to_none)
        if set_to_none and any_owner():
            release_cleared_gradients(self)

    _original.append(original)
    Optimizer.zero_grad = lazy_dynamo_disable(zero_grad)  # type: ignore[method-assign]


def release_cleared_gradients(optimizer: Optimizer) -> None:
    """Give back the memory of ``optimizer``'s kept gradients that only the
    library holds."""
    for ref in _gradients_of(optimizer):
        gradient = ref()
        if gradient is not None:
            gradient.release_if_free()


def _gradients_of(optimizer: Optimizer) -> tuple["weakref.ref[FlatGradient]", ...]:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    cached = _GRADIENTS.get(optimizer)
    if cached is not None and cached[0] == count:
        return cached[1]
    found: dict[int, FlatGradient] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            owner = owner_of(param)
            if owner is not None:
                found.setdefault(id(owner.buffer), owner.buffer.grad)
    refs = tuple(weakref.ref(gradient) for gradient in found.values())
    _GRADIENTS[optimizer] = (count, refs)
    return refs
