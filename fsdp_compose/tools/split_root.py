"""``fully_shard_root(model)``: annotate the root with its own parameters
split where they are used.

[Note: split root]
The root's leftover parameters (a GPT's embeddings, final norm and head)
as one unit are gathered before the first block and reduced after the last
backward node, overlapping nothing. ``fully_shard_root`` first annotates
the direct children before the first child holding units (the prologue)
and after the last (the epilogue) as units of their own, kept unsharded
from forward to backward, then the model: the epilogue's all-gather is
prefetched and its reduction overlaps the blocks' backward. Module order
stands for use order; a parameter shared between the parts splits nothing
(a ``UserWarning``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.nn as nn

from ..setup.units import managed_modules, taken
from ..api import fully_shard
from ..runtime.owners import owner_of
from ..runtime.state import state_of


def fully_shard_root(model: nn.Module, **fully_shard_kwargs: Any) -> nn.Module:
    """``fully_shard(model)`` after annotating the prologue and epilogue of its
    leftover parameters as units ([Note: split root]). Call it where
    ``fully_shard(model)`` would go; ``fully_shard_kwargs`` go to every call.
    Returns ``model``, annotated in place."""
    children = list(model.children())
    holds_units = [i for i, child in enumerate(children)
                   if any(state_of(m) is not None for m in child.modules())]
    if holds_units and state_of(model) is None:
        prologue = _untaken(children[:holds_units[0]])
        epilogue = _untaken(children[holds_units[-1] + 1:])
        rest = [model] + [c for i, c in enumerate(children)
                          if not any(c is m for m in prologue + epilogue)]
        shared = _shared_between([prologue, epilogue, rest])
        if shared is not None:
            warnings.warn(
                f"fully_shard_root: not splitting the root {type(model).__name__}: a parameter "
                f"({shared}) is used by more than one of its parts (e.g. tied embeddings), so "
                "its parameters stay in one unit.", UserWarning, stacklevel=2)
        else:
            kept = fully_shard_kwargs | {"reshard_after_forward": False}
            for part in (prologue, epilogue):
                if part:
                    fully_shard(part if len(part) > 1 else part[0], **kept)
    return fully_shard(model, **fully_shard_kwargs)


def _untaken(children: list[nn.Module]) -> list[nn.Module]:
    return [c for c in children if state_of(c) is None and _params(c)]


def _params(module: nn.Module) -> dict[int, str]:
    found = {}
    for sub in managed_modules([module], taken):
        for name, param in sub._parameters.items():
            if param is not None and owner_of(param) is None:
                found[id(param)] = name
    return found


def _shared_between(parts: list[list[nn.Module]]) -> str | None:
    """A parameter of two of ``parts``, by name; ``None`` if none."""
    seen: dict[int, int] = {}
    for index, part in enumerate(parts):
        for module in part:
            params = {id(p): n for n, p in module._parameters.items() if p is not None} \
                if module is parts[-1][0] else _params(module)
            for key, name in params.items():
                if seen.setdefault(key, index) != index:
                    return name
    return None
