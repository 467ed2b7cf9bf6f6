"""torch's ``Optimizer.zero_grad`` gives back the memory of the sharded gradients it clears.

fsdp_compose keeps each buffer's last published sharded gradient, and the
``.grad`` views into it, for the next reduction to write into ([Note: the
kept sharded gradient] in ``buffers/kept_gradient.py``). Its memory is
given back once nothing but the library holds it: at the root's next
pre-forward, and, once the first ``fully_shard`` ran (:func:`install`), as
soon as ``optimizer.zero_grad()`` (``set_to_none=True``, torch's default)
or ``model.zero_grad()`` (``ShardedModule.zero_grad``) cleared the
``.grad`` of its parameters, where torch FSDP2 frees them too. Between
``zero_grad`` and the next forward (a checkpoint save, an evaluation set
up, a memory reading) the memory is then what it is under FSDP2.

How: ``torch.optim.Optimizer.zero_grad`` (the base class's method, which
torch's optimizers inherit and most others call through ``super()``) is
replaced by a function that calls it and then, for the buffers holding the
optimizer's annotated parameters, releases each kept gradient that is free
(``FlatGradient.release_if_free``: nothing changes where a ``.grad``, or
anything the user keeps, still holds it, or where a reduction is pending).
Nothing else changes: the same gradients, the same values. An optimizer
over no annotated parameter costs one length check per call; one over
annotated parameters finds their buffers once (again when its parameter
count changes) and then asks each buffer's gradient per call.
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
"""torch's ``Optimizer.zero_grad`` while replaced."""

_GRADIENTS: "weakref.WeakKeyDictionary[Optimizer, tuple[int, tuple[weakref.ref[FlatGradient], ...]]]" = \
    weakref.WeakKeyDictionary()
"""Per optimizer: its parameter count when last looked at, and (weakly:
an optimizer that outlives its model keeps no buffer alive) the gradient of
every buffer that holds one of its annotated parameters."""


def install() -> None:
    """Replace ``Optimizer.zero_grad`` (once per process; ``fully_shard``
    calls this)."""
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
    """Give back the memory of every kept gradient of ``optimizer``'s
    annotated parameters that nothing but the library holds."""
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
