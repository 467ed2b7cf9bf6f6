"""Which parameters each planned unit takes (``fully_shard``'s own setup
code), and the annotations :func:`propose_units` tries."""

from __future__ import annotations

from typing import Iterator, NamedTuple, Sequence, Union

import torch.nn as nn

from ..._naming import join_fqn
from ...setup.units import collect_records, managed_modules
from ...buffers.records import ParamRecord
from ...runtime.state import ROOT_LABEL

UnitModules = Union[nn.Module, Sequence[nn.Module]]


class UnitSpec(NamedTuple):
    """One planned ``fully_shard`` call: label, modules, parameters taken."""

    name: str
    modules: tuple[nn.Module, ...]
    records: list[ParamRecord]


def default_units(model: nn.Module) -> list[UnitModules]:
    """Every child of every ``nn.ModuleList`` in ``model``, then ``model``."""
    return [child for m in model.modules() if isinstance(m, nn.ModuleList)
            for child in m.children()] + [model]




def resolve_units(model: nn.Module, units: Sequence[UnitModules]) -> list[UnitSpec]:
    """The parameters each unit takes, as ``fully_shard`` does."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    groups = [[u] if isinstance(u, nn.Module) else list(u) for u in units]
    if not groups or groups[-1] != [model]:
        raise ValueError("units must end with the model itself, the root unit: append model")
    annotated: set[int] = set()
    owner: dict[int, str] = {}
    specs = []
    for modules in groups:
        for m in modules:
            if id(m) not in names or id(m) in annotated:
                raise ValueError(f"{type(m).__name__} in units is not a submodule of the model "
                                 "or appears twice")
        label = ", ".join(names[id(m)] or ROOT_LABEL for m in modules)
        label = f"[{label}]" if len(modules) > 1 else label

        def check_owner(param: nn.Parameter, fqn: str, module: nn.Module,
                        unit_names: dict[int, str], label: str = label) -> None:
            if id(param) in owner:
                full = join_fqn(names[id(module)], fqn.rsplit(".", 1)[-1])
                raise ValueError(
                    f"parameter '{full}' of unit {label} is already in unit {owner[id(param)]} "
                    "(shared, e.g. tied embeddings): only their common ancestor can hold it")

        managed = managed_modules(modules, lambda child: id(child) in annotated)
        records = collect_records(modules, managed, set(), check_owner)
        owner.update(dict.fromkeys((id(r.param) for r in records), label))
        annotated.update(id(m) for m in modules)
        specs.append(UnitSpec(label, tuple(modules), records))
    return specs


def granularities(model: nn.Module) -> Iterator[list[UnitModules]]:
    """Annotations for :func:`propose_units`, coarse to fine, root last."""
    yield [model]
    units = default_units(model)[:-1]
    if units:
        yield [*units, model]
    units = _outside(model, units) + units
    frontier, count = units, len(units)
    while frontier:
        refined, new = [], []
        for m in units:
            kids = _parts(model, m) if any(m is f for f in frontier) else []
            refined += kids
            new += kids
            if not kids or _keeps_params(m, kids):
                refined.append(m)
        units, frontier = refined, new
        if new or len(units) != count:
            count = len(units)
            yield [*units, model]


def _unit_children(module: nn.Module) -> list[nn.Module]:
    out = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out += _unit_children(child)
        elif next(child.parameters(), None) is not None:
            out.append(child)
    return out


def _parts(model: nn.Module, module: nn.Module) -> list[nn.Module]:
    return [c for c in _unit_children(module) if _self_contained(model, c)]


def _outside(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The highest modules with parameters that neither are nor hold a block."""
    out = []
    for child in _unit_children(model):
        if any(child is b for b in blocks):
            continue
        if any(b is m for b in blocks for m in child.modules()):
            out += _outside(child, blocks)
        elif _self_contained(model, child):
            out.append(child)
    return out


def _self_contained(model: nn.Module, module: nn.Module) -> bool:
    inside = {id(m) for m in module.modules()}
    mine = {id(p) for p in module.parameters()}
    return not any(id(p) in mine for m in model.modules() if id(m) not in inside
                   for p in m._parameters.values() if p is not None)


def _keeps_params(module: nn.Module, kids: list[nn.Module]) -> bool:
    taken = {id(p) for k in kids for p in k.parameters()}
    return any(id(p) not in taken for p in module.parameters())
