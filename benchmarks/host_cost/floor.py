"""The floor of the design's host cost (``host_cost``'s ``floor`` and ``floor_checked``).

A unit here does only the torch work that fsdp_compose's design needs per
unit and step over one rank, with as little Python around it as possible:

- at pre-forward, one custom autograd node that hands out the parameters'
  aliases of the flat buffer (made once), set on the module attributes;
- at post-forward, a pre-hook on the output's node (where backward would
  unshard) and the original parameters put back;
- in backward, that node concatenates the parameters' gradients into the
  flat gradient, which autograd accumulates into the buffer, whose
  post-accumulate-grad hook takes it (where the reduce-scatter would be);
- at the end of backward (an autograd callback), each parameter's ``.grad``
  becomes its view of the flat gradient.

It shards nothing and supports nothing else (one rank, one dtype, no
padding, every parameter trainable, forward once per step): it is a
measuring stick, not an implementation. :class:`CheckedFloorUnit` adds the
three checks fsdp_compose makes at every forward (parameters registered
after annotation, ``requires_grad`` changes, in-place changes of a
parameter during forward). This floor's step minus the unsharded model's is
what the design costs at the least; the checked floor's minus this one is
what the checks cost; fsdp_compose's minus the checked floor's is what the
library's own bookkeeping (prefetch order, collective queue, gradient
accumulation, states and settings) costs per unit.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.nn as nn
from torch.autograd import Variable

from fsdp_compose.checks.late_parameters import check_no_late_parameters, snapshot_modules


class _Views(torch.autograd.Function):
    """Hands out ``aliases`` (views of ``flat``'s storage, made once); the
    backward concatenates their gradients into one flat gradient."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, aliases: tuple) -> tuple:  # type: ignore[override]
        return aliases

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        return torch._utils._flatten_dense_tensors(grads), None


_apply = super(torch.autograd.Function, _Views).apply  # without functorch's preamble


class FloorUnit:
    """The parameters of ``modules`` (every parameter not taken by a unit
    made earlier: ``taken`` holds their ids) in one flat buffer, driven by
    hooks on ``hooked``."""

    def __init__(self, modules: list[nn.Module], hooked: nn.Module, units: list["FloorUnit"],
                 taken: set[int]) -> None:
        self.slots: list[tuple[dict, str, int]] = []
        self.params: list[nn.Parameter] = []
        for top in modules:
            for sub in top.modules():
                for name, param in sub._parameters.items():
                    if param is not None and id(param) not in taken:
                        taken.add(id(param))
                        self.slots.append((sub._parameters, name, len(self.params)))
                        self.params.append(param)
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.flat = flat.requires_grad_()
        self.ranges: list[tuple[int, int]] = []
        start = 0
        for param in self.params:
            self.ranges.append((start, param.numel()))
            start += param.numel()
        storage = flat.untyped_storage()
        with torch.no_grad():
            self.aliases = tuple(flat.new_empty(0).set_(storage, s, p.shape, p.stride())
                                 for p, (s, _) in zip(self.params, self.ranges))
            for param, (s, n) in zip(self.params, self.ranges):
                param.data = flat.detach()[s:s + n]  # between steps: 1-D views of the buffer
        self.units = units
        self.pending: Optional[torch.Tensor] = None
        self.callback_queued = False
        self.flat.register_post_accumulate_grad_hook(lambda _flat: self._take_gradient())
        hooked.register_forward_pre_hook(lambda _module, _args: self._pre_forward())
        hooked.register_forward_hook(lambda _module, _args, output: self._post_forward(output))

    def _pre_forward(self) -> None:
        views = _apply(self.flat, self.aliases)
        for parameters, name, index in self.slots:
            parameters[name] = views[index]

    def _post_forward(self, output: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            output.grad_fn.register_prehook(lambda _grads: self._pre_backward())
        params = self.params
        for parameters, name, index in self.slots:
            parameters[name] = params[index]

    def _pre_backward(self) -> None:
        root = self.units[0]
        if not root.callback_queued:
            root.callback_queued = True
            Variable._execution_engine.queue_callback(root._end_of_backward)

    def _take_gradient(self) -> None:
        self.pending, self.flat.grad = self.flat.grad, None

    def _end_of_backward(self) -> None:
        self.callback_queued = False
        for unit in self.units:
            grad, unit.pending = unit.pending, None
            if grad is not None:
                for param, (s, n) in zip(unit.params, unit.ranges):
                    param.grad = grad[s:s + n]


_requires_grad = operator.attrgetter("requires_grad")
_version = operator.attrgetter("_version")


class CheckedFloorUnit(FloorUnit):
    """A floor unit that also makes fsdp_compose's per-forward checks, with
    the library's own late-parameter check and the same comparisons as
    ``FlatBuffer.sync_requires_grad`` and ``check_params_unmodified``."""

    def __init__(self, modules: list[nn.Module], hooked: nn.Module, units: list["FloorUnit"],
                 taken: set[int]) -> None:
        super().__init__(modules, hooked, units, taken)
        # its managed modules, as fully_shard's: not those of units made before it
        managed = [m for top in modules for m in top.modules() if id(m) not in taken]
        taken.update(map(id, managed))
        self.snapshot = snapshot_modules(managed)
        self.flags = tuple(map(_requires_grad, self.params))
        self.versions: Optional[tuple[int, ...]] = None

    def _pre_forward(self) -> None:
        check_no_late_parameters(self.snapshot, None)
        if tuple(map(_requires_grad, self.params)) != self.flags:
            raise RuntimeError("the floor supports no requires_grad change")
        super()._pre_forward()
        self.versions = tuple(map(_version, self.aliases))

    def _post_forward(self, output: torch.Tensor) -> None:
        super()._post_forward(output)
        if tuple(map(_version, self.aliases)) != self.versions:
            raise RuntimeError("a parameter was modified in place during forward")


def floor_units(model: nn.Module, blocks: nn.ModuleList, checked: bool = False
                ) -> list[FloorUnit]:
    """Every block a unit, the root (``model``: the rest) first, as
    ``fully_shard`` on each block and then on the model lays them out
    (``checked``: :class:`CheckedFloorUnit`)."""
    kind = CheckedFloorUnit if checked else FloorUnit
    units: list[FloorUnit] = []
    taken: set[int] = set()
    block_units = [kind([block], block, units, taken) for block in blocks]
    units.append(kind([model], model, units, taken))
    units.extend(block_units)
    return units
