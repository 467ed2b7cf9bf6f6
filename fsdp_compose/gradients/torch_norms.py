"""torch's gradient-norm functions give the global norm over managed gradients.

Each rank holds only its gradient shards, so torch's ``clip_grad_norm_`` and
``get_total_norm`` would clip every rank by a different factor. Once
``fully_shard`` runs, calls involving a managed tensor compute what
:func:`fsdp_compose.clip_grad_norm_` does; others run torch's code.

[Note: torch's norm functions]
Both are ``_no_grad`` wrappers whose closure cell holds the working
function (``clip_grad_norm_`` calls the module global ``_get_total_norm``).
Swapping those cells' contents reaches every reference, including earlier
imports; without such a cell the module attributes are patched (with a
warning). Recognised: a managed parameter or its current ``.grad`` (not
``g.float()``), or an empty list while a multi-rank unit exists (a rank
holding no gradient still joins). Ranks meet under the entry point's name,
so mixed entry points raise instead of pairing all-reduces.
"""

from __future__ import annotations

import types
import warnings
from typing import Callable, Iterable, Optional, Union

import torch
import torch.nn as nn
from torch.nn.utils import clip_grad as _torch_clip_grad

from .clip import clip_grad_norm_ as _sharded_clip_grad_norm_
from .clip import total_norm_over_ranks
from ..runtime.owners import any_owner, live_units, owner_of

__all__ = ["route_torch_grad_norms", "install", "is_routed"]

Tensors = Union[torch.Tensor, Iterable[torch.Tensor]]

_original: dict[str, Callable] = {}
_opted_out: list[bool] = []


def route_torch_grad_norms(enabled: bool = True) -> None:
    """Turn the routing of torch's ``clip_grad_norm_`` / ``get_total_norm``
    on (the default once ``fully_shard`` ran) or off. Process-wide; call it
    alike on every rank."""
    if enabled:
        _opted_out.clear()
        _route()
    else:
        _opted_out.append(True)
        _unroute()


def install() -> None:
    """Called by ``fully_shard``: route unless the user opted out."""
    if not _opted_out and not _original:
        _route()


def is_routed() -> bool:
    return bool(_original)


def _clip_grad_norm_(parameters: Tensors, max_norm: float, norm_type: float = 2.0,
                     error_if_nonfinite: bool = False,
                     foreach: Optional[bool] = None) -> torch.Tensor:
    was_generator = isinstance(parameters, types.GeneratorType)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if any_owner() and any(isinstance(p, nn.Parameter) and owner_of(p) is not None
                           for p in params):
        return _sharded_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    if was_generator:  # torch warns about an empty generator: give it one
        return _original["clip_grad_norm_"]((p for p in params), max_norm, norm_type,
                                            error_if_nonfinite, foreach)
    return _original["clip_grad_norm_"](params, max_norm, norm_type, error_if_nonfinite, foreach)


def _get_total_norm(tensors: Tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None) -> torch.Tensor:
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not tensors and any_owner():  # a rank holding none of the gradients
        params = _sharded_params()
        if params:
            return total_norm_over_ranks(params, norm_type, error_if_nonfinite, foreach,
                                         tensors=[None] * len(params), call=_GET_TOTAL_NORM)
    params = _managed_params_of(tensors)
    if params is None:
        return _original["get_total_norm"](tensors, norm_type, error_if_nonfinite, foreach)
    return total_norm_over_ranks(params, norm_type, error_if_nonfinite, foreach, tensors=tensors,
                                 call=_GET_TOTAL_NORM)


_GET_TOTAL_NORM = "torch.nn.utils.get_total_norm"


def _sharded_params() -> list[nn.Parameter]:
    return [record.param for unit in live_units() for buffer in unit.buffers
            if buffer.group.world_size > 1 for record in buffer.records]


def _managed_params_of(tensors: list[torch.Tensor]) -> Optional[list[torch.Tensor]]:
    """For each tensor, the managed parameter it is (or is the ``.grad`` of),
    else itself; ``None`` when none is managed."""
    # by identity, never by shape
    if not any_owner():
        return None
    owners: dict[int, nn.Parameter] = {}
    for unit in live_units():
        for buffer in unit.buffers:
            for record in buffer.records:
                grad = record.param.grad
                if grad is not None:
                    owners[id(grad)] = record.param
    found = False
    params: list[torch.Tensor] = []
    for t in tensors:
        param = owners.get(id(t))
        if param is None and isinstance(t, nn.Parameter) and owner_of(t) is not None:
            param = t  # a managed parameter: its weight norm
        found = found or param is not None
        params.append(t if param is None else param)
    return params if found else None


_ROUTED = {"clip_grad_norm_": _clip_grad_norm_, "get_total_norm": _get_total_norm}
_WRAPPERS = {"clip_grad_norm_": "clip_grad_norm_", "get_total_norm": "_get_total_norm"}


def _inner_cell(wrapper: Callable) -> Optional[types.CellType]:
    """The closure cell of torch's ``_no_grad`` wrapper holding the function it
    calls (``None``: built differently)."""
    inner = getattr(wrapper, "__wrapped__", None)
    cells = [c for c in (getattr(wrapper, "__closure__", None) or ())
             if c.cell_contents is inner or c.cell_contents in _ROUTED.values()]
    return cells[0] if len(cells) == 1 and callable(cells[0].cell_contents) else None


def _route() -> None:
    if _original:
        return
    cells = {name: _inner_cell(getattr(_torch_clip_grad, wrapper))
             for name, wrapper in _WRAPPERS.items()}
    if all(cell is not None for cell in cells.values()):
        for name, cell in cells.items():
            _original[name] = cell.cell_contents
            cell.cell_contents = _ROUTED[name]
        return
    warnings.warn("fsdp_compose: this torch's clip_grad functions are not _no_grad wrappers; "
                  "routing torch.nn.utils.clip_grad_norm_ / get_total_norm through module "
                  "attributes (references imported earlier keep torch's local norm).",
                  stacklevel=3)
    for name, wrapper in _WRAPPERS.items():
        _original[name] = getattr(_torch_clip_grad, wrapper)
        routed = _ROUTED[name]
        setattr(_torch_clip_grad, wrapper, routed)
        setattr(torch.nn.utils, name, routed)


def _unroute() -> None:
    if not _original:
        return
    for name, wrapper_name in _WRAPPERS.items():
        wrapper = getattr(_torch_clip_grad, wrapper_name)
        cell = _inner_cell(wrapper)
        if cell is not None and cell.cell_contents is _ROUTED[name]:
            cell.cell_contents = _original[name]
        else:
            setattr(_torch_clip_grad, wrapper_name, _original[name])
            setattr(torch.nn.utils, name, _original[name])
    _original.clear()
