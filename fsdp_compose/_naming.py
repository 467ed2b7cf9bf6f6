"""How messages name modules: the user's class behind an annotated module's
dynamic ``Sharded...`` class, and the modules holding a given module, found
without a root.

Parents are found through referrers (a parent's ``_modules`` dict), tested
by exact ``type(obj)``: ``isinstance`` reads ``__class__`` of arbitrary
objects (some warn). ``gc.get_referrers`` scans the heap, so only on error
paths and once per optimizer. A leaf module (no package imports).
"""

from __future__ import annotations

import gc
from typing import Iterable, Iterator

import torch.nn as nn

USER_CLASS_ATTR = "_fsdp_compose_user_class"
"""Set by ``module_methods.sharded_module.sharded_class``: the class it extends."""


def user_class_name(module: nn.Module) -> str:
    """``type(module).__name__``, or the original class's for an annotated module."""
    cls = type(module)
    return cls.__dict__.get(USER_CLASS_ATTR, cls).__name__


def join_fqn(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` under the root (``prefix == ""``)."""
    return f"{prefix}.{name}" if prefix else name


def outermost_ancestors(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The unheld modules holding one of ``modules`` (each once; an unheld
    module is its own)."""
    tops: dict[int, nn.Module] = {}
    seen: set[int] = set()
    todo = list(modules)
    while todo:
        module = todo.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        parents = list(_parents(module))
        if not parents:
            tops.setdefault(id(module), module)
        todo.extend(parents)
    return list(tops.values())


def qualified_names(tops: Iterable[nn.Module]) -> dict[int, str]:
    """By parameter id, its longest FQN under ``tops`` (the outermost's)."""
    tops = list(tops)
    return _longest(pair for top in tops for pair in top.named_parameters(remove_duplicate=False))


def module_qualified_names(tops: Iterable[nn.Module]) -> dict[int, str]:
    """The same for every module under ``tops`` (the outermost: ``""``)."""
    return _longest(pair for top in tops for pair in top.named_modules(remove_duplicate=False))


def _longest(named: Iterable[tuple[str, object]]) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, obj in named:
        if id(obj) not in names or len(name) > len(names[id(obj)]):
            names[id(obj)] = name
    return names


def _is_module(obj: object) -> bool:
    return issubclass(type(obj), nn.Module)


def _parents(module: nn.Module) -> Iterator[nn.Module]:
    for holder in gc.get_referrers(module):
        if type(holder) is not dict:
            continue
        for owner in gc.get_referrers(holder):
            if _is_module(owner) and vars(owner).get("_modules") is holder:
                yield owner
            elif type(owner) is dict and owner.get("_modules") is holder:
                # the parent's materialised instance __dict__
                yield from (m for m in gc.get_referrers(owner)
                            if _is_module(m) and vars(m) is owner)
