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

import operator
from itertools import chain
from typing import Iterable, NamedTuple, Optional

import torch.nn as nn

from .._torch_private import REGISTRY_KEY
from ..runtime.owners import owner_of
from .replicate import is_replicated

class ModuleSnapshot(NamedTuple):
    """What one managed module registered at annotation."""

    module: nn.Module
    params: dict[str, int]  # parameter name -> id
    children: dict[str, int]  # child module name -> id


class Snapshot(NamedTuple):
    """What the managed modules of one unit registered at annotation, and
    the same as one flat tuple of ids in registration order (the fast check)."""

    modules: tuple[ModuleSnapshot, ...]
    module_dicts: tuple[dict, ...]  # each module's __dict__ (where the registry lives)
    dicts: tuple[dict, ...]  # each module's _parameters, then each module's _modules
    ids: tuple[int, ...]  # the ids of every value of ``dicts``, in order


def snapshot_modules(managed_modules: Iterable[nn.Module]) -> Snapshot:
    """What each managed module registers now (taken at annotation)."""
    modules = tuple(managed_modules)
    entries = tuple(ModuleSnapshot(m, {n: id(p) for n, p in m._parameters.items() if p is not None},
                                   {n: id(c) for n, c in m._modules.items() if c is not None})
                    for m in modules)
    dicts = tuple(m._parameters for m in modules) + tuple(m._modules for m in modules)
    return Snapshot(entries, tuple(m.__dict__ for m in modules), dicts, _ids(dicts))


def _ids(dicts: tuple[dict, ...]) -> tuple[int, ...]:
    """The ids of every value of ``dicts``, in order (C-level loops only)."""
    return tuple(map(id, chain.from_iterable(map(dict.values, dicts))))


def check_no_late_parameters(snapshot: Snapshot, root: Optional[nn.Module]) -> None:
    """Raise if a managed module holds a parameter, or a child module with
    parameters no unit manages, that it did not hold at annotation (a new
    child that only wraps managed modules, e.g. an activation-checkpoint
    wrapper, is fine). Parameters may be swapped for plain tensors (the
    unsharded views) by the unit itself. Runs at every pre-forward: modules
    holding exactly the objects they held at annotation are checked by
    identity alone."""
    for registry in filter(None, map(_registry, snapshot.module_dicts)):
        if "replicate" in registry:
            for module, _, _ in snapshot.modules:
                if is_replicated(module):
                    _raise_replicated(module, root)
    if _ids(snapshot.dicts) == snapshot.ids:
        return
    for module, params, children in snapshot.modules:
        _check_params(module, params, root)
        _check_children(module, children, root)


_registry = operator.methodcaller("get", REGISTRY_KEY)
"""A module's composable-API registry, read from its ``__dict__`` (``None``: none)."""


def _check_params(module: nn.Module, params: dict[str, int], root: Optional[nn.Module]) -> None:
    for name, value in module._parameters.items():
        if value is None or params.get(name) == id(value) or not isinstance(value, nn.Parameter):
            continue
        _raise(module, name, root, "replaced" if name in params else "registered")


def _check_children(module: nn.Module, children: dict[str, int],
                    root: Optional[nn.Module]) -> None:
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
