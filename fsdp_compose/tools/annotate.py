"""``fully_shard_by(model, match)``: annotate every matching module bottom-up,
then the model itself; matches are found wherever they sit (inside a
``PeftModel``, inside checkpoint wrappers).

[Note: shared parameters in fully_shard_by]
A parameter registered inside a matched module and outside it (tied
embedding and head) would be freed and gathered again between its uses, so
``fully_shard_by`` skips such a module with a ``UserWarning`` naming both
FQNs: its parameters go to the nearest annotated ancestor. The decision
depends only on module structure: alike on every rank.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Union

import torch.nn as nn

from ..setup.units import managed_modules, taken
from ..api import fully_shard
from ..runtime.owners import owner_of
from ..runtime.state import state_of
from ._format import module_paths

Match = Union[type, tuple[type, ...], Callable[[str, nn.Module], bool]]


def fully_shard_by(model: nn.Module, match: Match, **fully_shard_kwargs: Any) -> nn.Module:
    """``fully_shard`` every module of ``model`` that ``match`` selects,
    children before parents, then ``model`` itself.

    Args:
        model: the whole model.
        match: a module class, a tuple of classes, or a predicate
            ``(fqn, module) -> bool`` (``fqn`` relative to ``model``).
        **fully_shard_kwargs: passed to every ``fully_shard`` call.

    Returns:
        ``model``, annotated in place. Modules annotated already are left
        alone; one sharing a parameter with the outside is skipped with a
        ``UserWarning`` ([Note: shared parameters in fully_shard_by]).

    Raises:
        TypeError: ``match`` is not a class, a tuple of classes or a callable."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fully_shard_by takes an nn.Module, got {type(model).__name__}")
    selects = _selector(match)
    if "ignored_params" in fully_shard_kwargs and fully_shard_kwargs["ignored_params"] is not None:
        # an iterator would be used up by the first call
        fully_shard_kwargs["ignored_params"] = list(fully_shard_kwargs["ignored_params"])
    ignored = {id(p) for p in fully_shard_kwargs.get("ignored_params") or ()}
    param_paths = _param_paths(model)
    paths = module_paths(model)
    for fqn, module in _bottom_up(model):
        if module is model or not selects(fqn, module) or state_of(module) is not None:
            continue
        shared = _shared_outside(module, paths[id(module)], param_paths, ignored)
        if shared is not None:
            inside, outside = shared
            warnings.warn(
                f"fully_shard_by: not annotating '{fqn}' ({type(module).__name__}): its parameter "
                f"'{inside}' is the same tensor as '{outside}' outside it (e.g. tied embeddings), "
                "so it stays with the nearest annotated ancestor (the model itself at the latest).",
                UserWarning, stacklevel=2)
            continue
        fully_shard(module, **fully_shard_kwargs)
    if state_of(model) is None:
        fully_shard(model, **fully_shard_kwargs)
    return model


def _selector(match: Match) -> Callable[[str, nn.Module], bool]:
    if isinstance(match, type):
        return lambda _fqn, module: isinstance(module, match)
    if isinstance(match, tuple) and match and all(isinstance(c, type) for c in match):
        return lambda _fqn, module: isinstance(module, match)
    if callable(match) and not isinstance(match, nn.Module):
        return lambda fqn, module: bool(match(fqn, module))
    hint = ""
    if isinstance(match, str):
        hint = (f" For a class name use a predicate: "
                f"lambda fqn, m: type(m).__name__ == {match!r}.")
    elif isinstance(match, nn.Module):
        hint = f" To match modules of its class pass type(module) ({type(match).__name__})."
    elif isinstance(match, (list, set, tuple)):
        hint = " Pass several classes as a non-empty tuple of classes."
    raise TypeError(
        "fully_shard_by's match must be a module class, a tuple of module classes or a "
        f"predicate (fqn, module) -> bool, got {type(match).__name__} {match!r}.{hint}")


def _bottom_up(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module once with its first FQN, in post-order."""
    order: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(prefix: str, module: nn.Module) -> None:
        seen.add(id(module))
        for name, child in module.named_children():
            if id(child) not in seen:
                visit(f"{prefix}.{name}" if prefix else name, child)
        order.append((prefix, module))

    visit("", model)
    return order


def _param_paths(model: nn.Module) -> dict[int, list[str]]:
    paths: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        paths.setdefault(id(param), []).append(name)
    return paths


def _shared_outside(module: nn.Module, prefixes: list[str], param_paths: dict[int, list[str]],
                    ignored: set[int]) -> tuple[str, str] | None:
    """``(name inside, name outside)`` of a parameter ``fully_shard(module)``
    would take that is registered outside ``module`` too."""

    def inside(name: str) -> bool:
        return any(not p or name.startswith(p + ".") for p in prefixes)

    for sub in managed_modules([module], taken):
        for param in sub._parameters.values():
            if param is None or id(param) in ignored or owner_of(param) is not None:
                continue
            names = param_paths.get(id(param), [])
            outside = [n for n in names if not inside(n)]
            if outside:
                return next(n for n in names if inside(n)), outside[0]
    return None
