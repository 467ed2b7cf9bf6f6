"""Parameters and modules registered after ``fully_shard``.

``fully_shard`` takes the parameters its modules hold when it is called. A
parameter registered (or replaced) later on one of those modules, or a new
child module with parameters of its own, would silently stay unsharded: full
size on every rank and its gradient never averaged across ranks. The unit
remembers what its modules held at annotation time, and every forward checks
that nothing was added (and that ``replicate`` was not applied to one of its
modules afterwards), raising an error that names the parameter or module.
Buffers are not looked at: registering or changing buffers stays fine.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch.nn as nn

from ..runtime.owners import owner_of
from .replicate import is_replicated

Snapshot = tuple[tuple[nn.Module, dict[str, int], dict[str, int]], ...]
"""Per managed module: (module, {param name: id}, {child name: id})."""


def snapshot_modules(managed_modules: Iterable[nn.Module]) -> Snapshot:
    """What each managed module registers now (taken at annotation)."""
    return tuple((m, {n: id(p) for n, p in m._parameters.items() if p is not None},
                  {n: id(c) for n, c in m._modules.items() if c is not None})
                 for m in managed_modules)


def check_no_late_parameters(snapshot: Snapshot, root: Optional[nn.Module]) -> None:
    """Raise if a managed module holds a parameter, or a child module with
    parameters no unit manages, that it did not hold at annotation (a new
    child that only wraps managed modules, e.g. an activation-checkpoint
    wrapper, is fine). Parameters may be swapped for plain tensors (the
    unsharded views) by the unit itself."""
    for module, params, children in snapshot:
        if is_replicated(module):
            _raise_replicated(module, root)
        for name, value in module._parameters.items():
            if value is None or params.get(name) == id(value) or not isinstance(value, nn.Parameter):
                continue
            _raise(module, name, root, "replaced" if name in params else "registered")
        if len(module._modules) == len(children) and all(
                children.get(n) == id(c) for n, c in module._modules.items()):
            continue
        for name, child in module._modules.items():
            if child is None or children.get(name) == id(child):
                continue
            new = _unmanaged_param(child)
            if new is not None:
                _raise(module, f"{name}.{new}", root, "registered")


def _unmanaged_param(top: nn.Module) -> Optional[str]:
    """The name (relative to ``top``) of a parameter in ``top``'s subtree
    that no ``fully_shard`` unit manages (unsharded views are managed)."""
    for name, p in top.named_parameters():
        if isinstance(p, nn.Parameter) and owner_of(p) is None:
            return name
    return None


def _raise(module: nn.Module, name: str, root: Optional[nn.Module], what: str) -> None:
    prefix = ""
    if root is not None:
        prefix = next((n for n, m in root.named_modules(remove_duplicate=False) if m is module), "")
    fqn = f"{prefix}.{name}" if prefix else name
    raise RuntimeError(
        f"parameter '{fqn}' was {what} on {type(module).__name__} after fully_shard annotated it; "
        "fully_shard does not manage it, so it would stay unsharded on every rank and its "
        "gradient would never be averaged across ranks. Register parameters (and modules that "
        "hold parameters) before calling fully_shard, or keep non-trainable state in buffers "
        "(register_buffer), which fully_shard leaves alone.")


def _raise_replicated(module: nn.Module, root: Optional[nn.Module]) -> None:
    name = next((n for n, m in root.named_modules(remove_duplicate=False) if m is module), "") \
        if root is not None else ""
    raise RuntimeError(
        f"module '{name or type(module).__name__}' was annotated by replicate() after fully_shard "
        "had taken its parameters; DDP would all-reduce shards. Call replicate() on it before "
        "fully_shard on its ancestor (fully_shard then leaves the replicated subtree alone).")
