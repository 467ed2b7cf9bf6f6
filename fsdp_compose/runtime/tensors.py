"""Finding the tensors inside arbitrary forward inputs and outputs, and
keeping parameter identity through module conversions."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch

from .._torch_private import pytree


def iter_tensors(obj: Any):
    """Every tensor in ``obj``, through lists, tuples, dicts, dataclasses and
    pytree containers."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name))
    elif type(obj) in pytree.SUPPORTED_NODES:
        for item in pytree.tree_leaves(obj):
            yield from iter_tensors(item)


def tensors_requiring_grad(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj`` that take part in autograd."""
    if isinstance(obj, torch.Tensor):  # most modules return one tensor
        return [obj] if obj.requires_grad else []
    return [t for t in iter_tensors(obj) if t.requires_grad]


def map_floating_tensors(obj: Any, fn) -> Any:
    """``fn`` on every floating-point tensor in ``obj``, through pytree
    containers and dataclasses (copied); other objects kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.is_floating_point() else obj
    if type(obj) in pytree.SUPPORTED_NODES:
        return pytree.tree_map(lambda leaf: map_floating_tensors(leaf, fn), obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_floating_tensors(getattr(obj, f.name), fn)
                   for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


@contextlib.contextmanager
def swapping_params_on_conversion(enabled: bool = True) -> Iterator[None]:
    """Inside, ``module._apply`` swaps parameter contents
    (``torch.utils.swap_tensors``) when ``enabled``, so ``nn.Parameter``
    objects keep their identity even leaving meta; torch's setting is
    restored on exit."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(before or enabled)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
