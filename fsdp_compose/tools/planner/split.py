"""The split root in a planned annotation ([Note: split root] in
``tools/split_root.py``), restated over the planned units.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional, Sequence

import torch.nn as nn

from ...setup.units import managed_modules
from .units import UnitModules


class SplitRoot(NamedTuple):
    """The annotation with the root split: ``units`` in call order; ``prologue``
    and ``epilogue`` index them (``None``: no such part)."""

    units: list[UnitModules]
    prologue: Optional[int]
    epilogue: Optional[int]


class RootParts(NamedTuple):
    """The children ``fully_shard_root`` would make units; ``shared``: a
    parameter used by two parts (then nothing is split)."""

    prologue: list[nn.Module]
    epilogue: list[nn.Module]
    shared: Optional[str]


def root_parts(model: nn.Module, units: Sequence[UnitModules]) -> RootParts:
    earlier = list(units[:-1])
    annotated = {id(m) for u in earlier for m in ([u] if isinstance(u, nn.Module) else u)}
    owned = {id(p) for u in earlier for m in ([u] if isinstance(u, nn.Module) else u)
             for p in m.parameters()}
    children = list(model.children())
    holds = [i for i, child in enumerate(children)
             if any(id(m) in annotated for m in child.modules())]
    if not holds:
        return RootParts([], [], None)

    def params(module: nn.Module) -> dict[int, str]:
        return {id(p): name for sub in managed_modules([module], lambda m: id(m) in annotated)
                for name, p in sub._parameters.items() if p is not None and id(p) not in owned}

    prologue, epilogue = ([c for c in part if id(c) not in annotated and params(c)]
                          for part in (children[:holds[0]], children[holds[-1] + 1:]))
    in_parts = {id(c) for c in prologue + epilogue}
    rest = {id(p): n for n, p in model._parameters.items() if p is not None}
    for child in children:
        if id(child) not in in_parts:
            rest.update(params(child))
    seen: dict[int, int] = {}
    for index, found in enumerate([{k: v for c in prologue for k, v in params(c).items()},
                                   {k: v for c in epilogue for k, v in params(c).items()}, rest]):
        for key, name in found.items():
            if seen.setdefault(key, index) != index:
                return RootParts(prologue, epilogue, name)
    return RootParts(prologue, epilogue, None)


def split_root(model: nn.Module, units: Sequence[UnitModules]) -> SplitRoot:
    """``units`` as ``fully_shard_root(model)`` would annotate it."""
    parts = root_parts(model, units)
    if parts.shared is not None:
        warnings.warn(
            f"split_root: not splitting the root {type(model).__name__}: a parameter "
            f"({parts.shared}) is used by more than one of its parts (e.g. tied embeddings), "
            "so its parameters stay in one unit.", UserWarning, stacklevel=3)
        return SplitRoot(list(units), None, None)
    out: list[UnitModules] = list(units[:-1])
    indices: list[Optional[int]] = []
    for part in (parts.prologue, parts.epilogue):
        indices.append(len(out) if part else None)
        if part:
            out.append(part if len(part) > 1 else part[0])
    return SplitRoot(out + [model], indices[0], indices[1])
