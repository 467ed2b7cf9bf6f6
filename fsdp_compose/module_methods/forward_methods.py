"""Methods other than ``forward`` that use the parameters like ``forward``.

Only ``module(...)`` runs the hooks that unshard a unit; a method such as
``generate`` would see this rank's shards unless registered::

    fully_shard(model)
    register_forward_method(model, "generate")
    tokens = model.generate(input_ids, max_new_tokens=8)

The unit is all-gathered once before the method and, unless autograd needs
the parameters, resharded after it; its inner ``module(...)`` calls are part
of that pass.
"""

from __future__ import annotations

import functools
import types

import torch.nn as nn

from ..runtime.state import state_of

_WRAPPED = "_fsdp_compose_forward_method"


def register_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` unshard and reshard ``module``'s
    unit as ``module(...)`` does, on this instance only (not the class).

    Args:
        module: annotated by :func:`fully_shard` (one module of a
            multi-module unit is fine).
        method_name: a method other than ``forward``; registering it again
            is a no-op.

    Raises:
        ValueError: ``module`` is not annotated, or ``method_name`` is
            ``"forward"``.
        AttributeError: ``module`` has no callable attribute ``method_name``.
    """
    state = state_of(module)
    if state is None:
        raise ValueError(
            f"register_forward_method({type(module).__name__}, {method_name!r}): the module is not "
            "annotated by fully_shard; call fully_shard(module) first.")
    if method_name == "forward":
        raise ValueError("register_forward_method: forward already unshards the parameters; "
                         "pass the name of another method, e.g. 'generate'.")
    method = getattr(module, method_name, None)
    if not callable(method):
        raise AttributeError(f"{type(module).__name__} has no method {method_name!r}")
    if getattr(method, _WRAPPED, False):
        return
    func = method.__func__ if isinstance(method, types.MethodType) else None

    @functools.wraps(method)
    def wrapped(self: nn.Module, *args, **kwargs):
        call = (lambda *a, **k: func(self, *a, **k)) if func is not None else method
        return state.run_forward_method(self, call, args, kwargs)

    setattr(wrapped, _WRAPPED, True)
    setattr(module, method_name, types.MethodType(wrapped, module))


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """FSDP2's contract for :func:`register_forward_method`: a no-op on a
    module that is not annotated; ``ValueError`` where it has no
    ``method_name``."""
    if state_of(module) is None:
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    register_forward_method(module, method_name)
