"""The module attributes a flat buffer's parameters are registered under, holding the original
``nn.Parameter`` while sharded and its unsharded view while unsharded (the view last given to
:meth:`ParamSlots.set_views`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from .records import ParamRecord

ModuleSlots = tuple[tuple[dict, dict], ...]
"""Per ``module._parameters`` dict with a slot: ``(that dict, {name: value})``."""


class ParamSlots:
    """Every ``(module._parameters, name)`` a buffer's parameters are registered under (a tied
    parameter has several).

    Attributes:
        originals: per module, its slots' original parameters.
        views_by_module: per module, its slots' unsharded views."""

    __slots__ = ("records", "originals", "views_by_module", "_slots", "_dicts", "_names",
                 "_held", "_views")

    def __init__(self, records: Sequence[ParamRecord]) -> None:
        self.records: Sequence[ParamRecord] = records
        self.views_by_module: ModuleSlots = ()
        self._views: Sequence[torch.Tensor] = ()
        self._index()

    def _index(self) -> None:
        records = self.records
        self._slots: tuple[tuple[dict, str, int], ...] = tuple(
            (module._parameters, name, index)
            for index, record in enumerate(records) for module, name in record.slots)
        self.originals: ModuleSlots = self._by_module([r.param for r in records])
        self._dicts: tuple[dict, ...] = tuple(parameters for parameters, _, _ in self._slots)
        self._names: tuple[str, ...] = tuple(name for _, name, _ in self._slots)
        self._held: tuple[nn.Parameter, ...] = tuple(
            records[index].param for _, _, index in self._slots)
        if self._views:
            self.views_by_module = self._by_module(self._views)

    def add(self, index: int, module: nn.Module, name: str) -> None:
        """Parameter ``index`` is registered as ``module.<name>`` too (a tied weight of another
        unit)."""
        self.records[index].slots.append((module, name))
        self._index()

    def _by_module(self, values: Sequence[object]) -> ModuleSlots:
        by_module: dict[int, tuple[dict, dict]] = {}
        for parameters, name, index in self._slots:
            by_module.setdefault(id(parameters), (parameters, {}))[1][name] = values[index]
        return tuple(by_module.values())

    def set_views(self, views: Sequence[torch.Tensor]) -> None:
        self._views = views
        self.views_by_module = self._by_module(views)

    def swap_in_views(self) -> None:
        """Sharded -> unsharded. A slot holding another ``nn.Parameter`` was written behind the
        module API, which the late-parameter check does not see: an error, rather than putting
        the original back over it."""
        for parameters, name, original in zip(self._dicts, self._names, self._held):
            if parameters.get(name) is not original:
                self._check_not_replaced()
                break
        self.put_views()

    def put_views(self) -> None:
        for parameters, views in self.views_by_module:
            parameters.update(views)

    def put_originals(self) -> None:
        for parameters, originals in self.originals:
            parameters.update(originals)

    def _check_not_replaced(self) -> None:
        """Raise if a slot holds an ``nn.Parameter`` other than its original."""
        for parameters, name, index in self._slots:
            held = parameters.get(name)
            record = self.records[index]
            if held is record.param or not isinstance(held, nn.Parameter):
                continue
            module = next(m for m, attr in record.slots
                          if m._parameters is parameters and attr == name)
            raise RuntimeError(
                f"parameter '{record.fqn}' (attribute '{name}' of {type(module).__name__}) was "
                "replaced after fully_shard annotated it, by a write into _parameters; "
                "fully_shard does not manage the new one, and would put the original back over "
                "it at the next reshard. Register parameters before calling fully_shard; to give "
                "a parameter new values, load them with model.load_state_dict().")
