"""Parameters and modules registered after ``fully_shard``.

``fully_shard`` takes the parameters its modules hold when it is called. A
parameter registered (or replaced) later on one of those modules, or a new
child module with parameters of its own, would silently stay unsharded: full
size on every rank and its gradient never averaged across ranks. The unit
remembers what its modules held at annotation time, and every forward checks
that nothing was added (and that ``replicate`` was not applied to one of its
modules afterwards), raising an error that names the parameter or module.
Buffers are not looked at: registering or changing buffers stays fine.

[Note: the late-parameter fast check]
Comparing the ids of every managed module's parameters and children with
the annotation's, at every forward of every unit, was the costliest of the
per-forward checks on the host-cost proxy. A forward compares two cheaper
things instead, and runs that
full comparison only when one of them changed:

* the number of registrations through ``nn.Module``'s API since the last
  full check: every way the API adds or replaces a parameter or a child
  (``__setattr__``, ``register_parameter``, ``add_module``/``register_module``
  and what is built on them: ``ModuleList.append``, ``ModuleDict``,
  ``ParameterList``, ``load_state_dict(assign=True)``, PEFT's injection)
  runs torch's global registration hooks, and ours counts them;
* the sizes of the dicts a late addition lands in, which catch the ways
  around those hooks: each managed module's ``_parameters`` and ``_modules``
  (``ModuleList.insert`` and ``Sequential.insert`` write ``_modules``
  directly, ``del`` removes), its ``__dict__`` (a composable-API registry
  created by a late ``replicate()``) and each registry already there
  (``replicate()`` on a module ``fully_shard`` registered in).

A full check that passes takes the new sizes and count as the baseline, so
a legitimate change (an activation-checkpoint wrapper inserted after
annotation, another model built in the process) costs one full check, not
one per forward. The one write neither sees, an ``nn.Parameter`` put
straight into ``module._parameters`` under a name a managed parameter
holds (no hook, no size change), is caught where the unit swaps that slot
anyway: the unshard finds something other than the original parameter
there (``ParamSlots.swap_in_views``).
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
    """What one managed module registered at annotation."""

    module: nn.Module
    params: dict[str, int]  # parameter name -> id
    children: dict[str, int]  # child module name -> id


class Snapshot:
    """What the managed modules of one unit registered at annotation, and
    what the fast check compares (see [Note: the late-parameter fast check])."""

    __slots__ = ("modules", "watched", "sizes", "registrations")

    def __init__(self, modules: tuple[ModuleSnapshot, ...]) -> None:
        self.modules: tuple[ModuleSnapshot, ...] = modules
        self.watched: tuple[dict, ...] = ()
        """Each managed module's ``__dict__``, ``_parameters`` and ``_modules``,
        then each composable-API registry, as of the last full check."""
        self.sizes: tuple[int, ...] = ()
        """The sizes of ``watched`` then."""
        self.registrations: int = -1
        """:data:`_registrations` then (``-1``: no full check yet)."""

    def take_baseline(self) -> None:
        """What a full check that passed saw becomes what the fast check
        compares with."""
        modules = [entry.module for entry in self.modules]
        dicts = [d for m in modules for d in (m.__dict__, m._parameters, m._modules)]
        dicts.extend(filter(None, map(_registry, (m.__dict__ for m in modules))))
        self.watched = tuple(dicts)
        self.sizes = tuple(map(len, self.watched))
        self.registrations = _registrations


_registrations = 0
"""Parameters and modules registered through ``nn.Module``'s API in this
process since the first annotation (torch's global registration hooks)."""


_counting: list[object] = []
"""The handles of the two hooks that count :data:`_registrations` (installed
at the first annotation, kept for the life of the process)."""


def _count_registration(_module: nn.Module, _name: str, _value: object) -> None:
    global _registrations
    _registrations += 1


def snapshot_modules(managed_modules: Iterable[nn.Module]) -> Snapshot:
    """What each managed module registers now (taken at annotation)."""
    if not _counting:
        _counting.append(register_module_parameter_registration_hook(_count_registration))
        _counting.append(register_module_module_registration_hook(_count_registration))
    return Snapshot(tuple(
        ModuleSnapshot(m, {n: id(p) for n, p in m._parameters.items() if p is not None},
                       {n: id(c) for n, c in m._modules.items() if c is not None})
        for m in managed_modules))


def check_no_late_parameters(snapshot: Snapshot, root: Optional[nn.Module]) -> None:
    """Raise if a managed module holds a parameter, or a child module with
    parameters no unit manages, that it did not hold at annotation (a new
    child that only wraps managed modules, e.g. an activation-checkpoint
    wrapper, is fine), or was annotated by ``replicate`` since. Parameters
    may be swapped for plain tensors (the unsharded views) by the unit
    itself. Runs at every pre-forward: where no registration happened and
    no watched dict changed size, one comparison (see [Note: the
    late-parameter fast check])."""
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
