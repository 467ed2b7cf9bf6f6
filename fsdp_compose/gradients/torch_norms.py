"""torch's gradient-norm functions give the global norm over managed gradients.

Training loops and frameworks call ``torch.nn.utils.clip_grad_norm_(
model.parameters(), max_norm)`` and ``torch.nn.utils.get_total_norm(grads)``.
Over a model annotated by ``fully_shard`` each rank holds only its shard of
the gradients (its rows, or a 1-D piece under ``"flat"``), so torch's own code would return this rank's local norm and
clip every rank by a different factor. Once the first ``fully_shard`` runs
(:func:`install`), both functions recognise managed parameters and gradients
and compute what :func:`fsdp_compose.clip_grad_norm_` computes: the norm
over every rank (one scalar all-reduce), the same on every rank, equal to
torch's result on the unsharded model. Calls that involve no managed tensor
run torch's code unchanged (bit for bit). ``route_torch_grad_norms(False)``
turns it off (torch's functions are restored).

[Note: torch's norm functions]
Where: ``torch.nn.utils.get_total_norm`` *is* ``clip_grad._get_total_norm``,
and ``clip_grad_norm_`` calls that module global; both are ``_no_grad``
wrappers whose closure cell ``func`` holds the function that does the work.
We swap the content of those two cells, so every reference reaches the
routing, including ``from torch.nn.utils import clip_grad_norm_`` made
before fsdp_compose was imported (patching module attributes would miss
those). The wrappers keep ``__wrapped__`` (torch's signature and docs).
If a torch version has no such cell, the module attributes are patched
instead (references taken earlier then keep torch's code: a warning says so).

What is recognised:
  * ``clip_grad_norm_(parameters, ...)``: a parameter ``fully_shard``
    manages (``owner_of``); then the whole call is
    :func:`fsdp_compose.clip_grad_norm_` (unmanaged parameters in the same
    call count as replicated, once).
  * ``get_total_norm(tensors, ...)``: a tensor that is the current ``.grad``
    of a managed parameter (an empty one on a rank that owns no element of
    it included), or a managed parameter itself (a weight norm). Other
    tensors in the same call count as replicated (once). A tensor *derived*
    from a managed gradient (``g.float()`` of a bf16 gradient, a slice, a
    ``torch.cat``) is not recognised: call :func:`fsdp_compose.clip_grad_norm_`
    or :func:`fsdp_compose.param_norms` on the parameters instead.
  * An empty list, while a unit sharded over several ranks exists: this
    rank holds none of the gradients the other ranks pass (under
    ``"owned"`` a rank that owns no matrix has ``.grad is None`` for all of
    them, so ``[p.grad ... if p.grad is not None]`` is empty there). It
    joins the collective with nothing to add; on every rank an empty list
    gives 0, as in one process.

Ranks meet before the all-reduce under the name of the entry point
(``torch.nn.utils.get_total_norm`` or ``fsdp_compose.clip_grad_norm_``), so
a rank in ``get_total_norm`` and another in ``clip_grad_norm_`` raise
(``CallMismatchError``) instead of pairing their all-reduces.

Collectives: every rank must pass the same parameters / the gradients of
the same parameters (as with any collective); ``fully_shard`` publishes a
gradient on every rank when any rank used the parameter, so
``[p.grad for p in params if p.grad is not None]`` agrees across ranks.

Cost: nothing outside these two functions (the optimizer step, backward
and forward are untouched). Inside them, for calls with no managed tensor,
one dictionary lookup per parameter (``clip_grad_norm_``) or, while any
unit exists, one pass over the managed parameters (``get_total_norm``;
recognised by identity, whatever their shape); measured in
``benchmarks/torch_norms.py``.
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
"""torch's functions while routed: ``"clip_grad_norm_"``, ``"get_total_norm"``."""
_opted_out: list[bool] = []
"""Non-empty once the user called ``route_torch_grad_norms(False)``."""


# ------------------------------------------------------------------ public
def route_torch_grad_norms(enabled: bool = True) -> None:
    """Turn the routing of torch's ``clip_grad_norm_`` / ``get_total_norm``
    through fsdp_compose's global norms on (default once ``fully_shard`` ran)
    or off (torch's own code: local norms over managed gradients, see the
    module docstring). Process-wide; call it the same way on every rank."""
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


# ------------------------------------------------------- routed functions
def _clip_grad_norm_(parameters: Tensors, max_norm: float, norm_type: float = 2.0,
                     error_if_nonfinite: bool = False,
                     foreach: Optional[bool] = None) -> torch.Tensor:
    """torch's ``clip_grad_norm_``, global over managed parameters."""
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
    """torch's ``get_total_norm``, global over managed gradients and parameters."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not tensors and any_owner():  # see "An empty list" in the module docstring
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
    """Every managed parameter of a live unit sharded over several ranks."""
    return [record.param for unit in live_units() for buffer in unit.buffers
            if buffer.group.world_size > 1 for record in buffer.records]


def _managed_params_of(tensors: list[torch.Tensor]) -> Optional[list[torch.Tensor]]:
    """For each tensor: the managed parameter whose local part it is (its
    ``.grad`` or itself), else the tensor itself (replicated). ``None``
    when no tensor is managed."""
    # by identity, never by shape: under "rows", "owned" or Shard(d) managed
    # gradients keep their number of dimensions
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
            param = t  # a managed parameter itself: its weight norm
        found = found or param is not None
        params.append(t if param is None else param)
    return params if found else None


# ------------------------------------------------------------- the patch
_ROUTED = {"clip_grad_norm_": _clip_grad_norm_, "get_total_norm": _get_total_norm}
_WRAPPERS = {"clip_grad_norm_": "clip_grad_norm_", "get_total_norm": "_get_total_norm"}
"""Our name -> the wrapper's name in ``torch.nn.utils.clip_grad``."""


def _inner_cell(wrapper: Callable) -> Optional[types.CellType]:
    """The closure cell of torch's ``_no_grad`` wrapper that holds the
    function it calls (``None`` if this torch builds it differently)."""
    inner = getattr(wrapper, "__wrapped__", None)
    cells = [c for c in (getattr(wrapper, "__closure__", None) or ())
             if c.cell_contents is inner or c.cell_contents in _ROUTED.values()]
    return cells[0] if len(cells) == 1 and callable(cells[0].cell_contents) else None


def _route() -> None:
    if _original:
        return  # already routed
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
        return  # not routed
    for name, wrapper_name in _WRAPPERS.items():
        wrapper = getattr(_torch_clip_grad, wrapper_name)
        cell = _inner_cell(wrapper)
        if cell is not None and cell.cell_contents is _ROUTED[name]:
            cell.cell_contents = _original[name]
        else:  # routed through module attributes
            setattr(_torch_clip_grad, wrapper_name, _original[name])
            setattr(torch.nn.utils, name, _original[name])
    _original.clear()
