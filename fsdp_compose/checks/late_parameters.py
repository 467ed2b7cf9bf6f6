"""Parameters and modules registered after ``fully_shard``, which would
silently stay unsharded: every forward checks that nothing was added (nor
``replicate`` applied) and names what was. Buffers are not looked at.

[Note: the late-parameter fast check]
The full comparison runs only when one of two cheap things changed: the
count of registrations through ``nn.Module``'s API (torch's global hooks),
or the sizes of the dicts a late addition lands in otherwise
(``_parameters``, ``_modules``, ``__dict__``, composable-API registries). A
passing full check is the new baseline. A parameter written straight into
``_parameters`` under a managed name is caught by
``ParamSlots.swap_in_views``.
"""

from __future__ import annotations

import operator
from typing import Iterable, NamedTuple, Optional

import torch.nn as nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from .._torch_private import REGISTRY_KEY
from ..runtime.owners import owner_of
from .._naming import user_class_name
from .replicate import is_replicated


class ModuleSnapshot(NamedTuple):

    module: nn.Module
    params: dict[str, int]  # parameter name -> id
    children: dict[str, int]  # child module name -> id


class Snapshot:
    """What one unit's managed modules registered at annotation, and what the
    fast check compares."""

    __slots__ = ("modules", "watched", "sizes", "registrations")

    def __init__(self, modules: tuple[ModuleSnapshot, ...]) -> None:
        self.modules: tuple[ModuleSnapshot, ...] = modules
        self.watched: tuple[dict, ...] = ()
        """The dicts the fast check watches, as of the last full check."""
        self.sizes: tuple[int, ...] = ()
        self.registrations: int = -1
        """``-1``: no full check yet."""

    def take_baseline(self) -> None:
        """Take what a passing full check saw as the fast check's baseline."""
        modules = [entry.module for entry in self.modules]
        dicts = [d for m in modules for d in (m.__dict__, m._parameters, m._modules)]
        dicts.extend(filter(None, map(_registry, (m.__dict__ for m in modules))))
        self.watched = tuple(dicts)
        self.sizes = tuple(map(len, self.watched))
        self.registrations = _registrations


_registrations = 0
"""Registrations through ``nn.Module``'s API since the first annotation."""


_counting: list[object] = []


def _count_registration(_module: nn.Module, _name: str, _value: object) -> None:
    global _registrations
    _registrations += 1


def snapshot_modules(managed_modules: Iterable[nn.Module]) -> Snapshot:
    if not _counting:
        _counting.append(register_module_parameter_registration_hook(_count_registration))
        _counting.append(register_module_module_registration_hook(_count_registration))
    return Snapshot(tuple(
        ModuleSnapshot(m, {n: id(p) for n, p in m._parameters.items() if p is not None},
                       {n: id(c) for n, c in m._modules.items() if c is not None})
        for m in managed_modules))


def check_no_late_parameters(snapshot: Snapshot, root: Optional[nn.Module]) -> None:
    """Raise if a managed module holds a parameter, or a child with unmanaged
    parameters, it did not hold at annotation, or was annotated by
    ``replicate`` since."""
    if _registrations == snapshot.registrations and \
            tuple(map(len, snapshot.watched)) == snapshot.sizes:
        return
    for module, _, _ in snapshot.modules:
        if is_replicated(module):
            _raise_replicated(module, root)
    for module, params, children in snapshot.modules:
        _check_params(module, params, root)
        _check_children(module, children, root)
    snapshot.take_baseline()


_registry = operator.methodcaller("get", REGISTRY_KEY)
"""A module's composable-API registry, or ``None``."""


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
    """A parameter under ``top`` no unit manages (its name), or ``None``."""
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
        f"parameter '{fqn}' was {what} on {user_class_name(module)} after fully_shard annotated it; "
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
