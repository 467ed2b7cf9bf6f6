"""Models larger than one rank: deferred (meta-device) initialisation and
ranks agreeing on initial values.

[Note: initialising as if eagerly]
``materialize`` calls each module's ``reset_parameters()`` (or ``init_fn``)
in ``model.modules()`` order with its own parameters whole, so fan-in
initialisers see the full shape. Every rank runs the same initialisers from
the same random state and keeps its slice: with the same seed the values
equal the eager model's (same device type). At most one unit is whole at a
time; closing one compares a checksum across ranks (differently seeded
ranks raise).
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..buffers.flat_buffer import FlatBuffer
from ..buffers.tensor_parallel import as_dtensor
from ..comm.agreement import disagreement, fingerprint_of
from ..comm.groups import backend_device
from ..comm.rendezvous import arrive
from ..runtime.owners import owner_of
from ..runtime.state import units_below
from ..runtime.unit import Unit
from .meta import allocate_meta
from .whole import Assembled, gather_values, keep_own_slice, point_params_at

InitFn = Callable[[nn.Module], None]


def materialize(module: nn.Module, *, device: Optional[torch.device] = None,
                init_fn: Optional[InitFn] = None) -> nn.Module:
    """Allocate what ``module`` holds on the meta device and initialise it unit
    by unit ([Note: initialising as if eagerly]). Collective: call on every
    rank with the same seed.

    Args:
        module: a model annotated on the meta device (unannotated parts are
            materialised whole).
        device: where unannotated parameters and buffers go (default: the
            units' compute device; CPU without units).
        init_fn: called as ``init_fn(m)`` for every module in order with its
            own parameters whole. Default: ``m.reset_parameters()``.

    Returns:
        ``module``; parameters keep their identity."""
    units = units_below(module)
    arrive(units[0].group.process_group if units else None, "fsdp_compose.materialize",
           "Call it on every rank, with the same seed.")
    allocate_meta(module, device)
    for unit in units:
        unit.reshard()
    walk = _InitWalk()
    uninitialised = []
    for name, sub in module.named_modules():
        init = _initialiser(sub, init_fn)
        if init is None:
            if any(p is not None for p in sub._parameters.values()):
                uninitialised.append(f"'{name}' ({type(sub).__name__})")
            continue
        if any(p is not None for p in sub._parameters.values()):
            walk.enter(walk.unit_holding(sub))  # else keep the open unit
        with torch.no_grad():
            init()
    walk.enter(None)
    if uninitialised:
        warnings.warn(
            f"materialize: {', '.join(uninitialised)} hold parameters but have no "
            "reset_parameters(); their values are whatever an ancestor's reset_parameters() "
            "wrote, or uninitialised memory. Pass init_fn to initialise them.", stacklevel=2)
    return module


def sync_module_states(module: nn.Module, src: int = 0,
                       group: Optional[dist.ProcessGroup] = None) -> nn.Module:
    """Give every rank ``src``'s parameters and buffers in place (FSDP1's
    ``sync_module_states``), before ``fully_shard``; other ranks may hold
    meta tensors. Collective."""
    managed = [name for name, p in module.named_parameters() if owner_of(p) is not None]
    if managed:  # raised on every rank
        raise ValueError(
            f"sync_module_states got a module whose parameters are already sharded by "
            f"fully_shard (e.g. '{managed[0]}'), so no rank holds their whole values. Call "
            "sync_module_states(model) before fully_shard, or load the values from rank 0 "
            "with fsdp_compose.checkpoint.scatter_full_state_dict(model, state_dict, src=0).")
    device = backend_device(group)
    with torch.no_grad():
        for sub in module.modules():
            for table in (sub._parameters, sub._buffers):
                for name, tensor in table.items():
                    if tensor is None:
                        continue
                    if tensor.is_meta:
                        tensor = _allocate(sub, table, name, tensor, device)
                    staged = tensor.detach().to(device)
                    dist.broadcast(staged, src=src, group=group)
                    if staged is not tensor:
                        tensor.detach().copy_(staged)
    return module


class _InitWalk:
    """Keeps at most one unit whole while modules are initialised in order."""

    def __init__(self) -> None:
        self.unit: Optional[Unit] = None
        self.full: list[torch.Tensor] = []
        self.assembled: list[Assembled] = []
        self.shown: list[tuple[nn.Module, str, nn.Parameter]] = []
        """Slots showing a tensor-parallel parameter as a ``DTensor`` while its unit
        is whole: (module, name, parameter to put back)."""

    def unit_holding(self, module: nn.Module) -> Optional[Unit]:
        """The unit managing ``module``'s own parameters."""
        if any(m is module for m, _, _ in self.shown):
            return self.unit
        return _unit_holding(module)

    def enter(self, unit: Optional[Unit]) -> None:
        if unit is self.unit:
            return
        if self.unit is not None:
            self._close()
        self.unit = unit
        if unit is not None:
            self.full = [gather_values(buffer) for buffer in unit.buffers]
            for buffer, full in zip(unit.buffers, self.full):
                self.assembled.append(point_params_at(buffer, full))
                self.shown += _show_tensor_parallel(buffer)

    def _close(self) -> None:
        unit = self.unit
        for module, attr, param in self.shown:
            module._parameters[attr] = param
        self.shown = []
        for buffer, full, copies in zip(unit.buffers, self.full, self.assembled):
            keep_own_slice(buffer, full, copies)
        self.assembled = []
        _check_same_values(unit, self.full)
        for full in self.full:
            if full.device.type == "cpu":  # see [Note: freeing what a collective read]: gloo's
                full.untyped_storage().resize_(0)  # thread may still hold the gather's output
        self.full = []


def _checksum(values: torch.Tensor) -> tuple[float, float]:
    """Sums over all elements and every other one, in the values' dtype (no
    copy)."""
    values = values.detach()
    return float(values.sum()), float(values[::2].sum())


def _show_tensor_parallel(buffer: FlatBuffer) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Show tensor-parallel parameters to initialisers as the ``DTensor`` they
    were (fan-in from the global shape). Returns what to put back."""
    shown = []
    for record in buffer.records:
        if record.tp is None:
            continue
        dtensor = nn.Parameter(as_dtensor(record.param.data, record.tp),
                               requires_grad=record.param.requires_grad)
        for module, attr in record.slots:
            shown.append((module, attr, record.param))
            module._parameters[attr] = dtensor
    return shown


def _check_same_values(unit: Unit, full: list[torch.Tensor]) -> None:
    for group, indices in unit.buffers_by_group():
        checksums = [_checksum(full[i]) for i in indices]
        _raise_if_differ(unit, disagreement(fingerprint_of(repr(checksums)), group))


def _raise_if_differ(unit: Unit, differ: object) -> None:
    if differ is not None:
        raise RuntimeError(
            f"materialize: ranks {differ.differing} initialised different values than rank "
            f"{differ.reference} for {unit.name} (first parameter "
            f"'{unit.buffers[0].records[0].fqn}'). Seed every rank the same "
            "(torch.manual_seed(seed)) before materialize, and use an init_fn that depends "
            "only on the module.")


def _initialiser(module: nn.Module, init_fn: Optional[InitFn]) -> Optional[Callable[[], None]]:
    if init_fn is not None:
        return lambda: init_fn(module)
    reset = getattr(module, "reset_parameters", None)
    return reset if callable(reset) else None


def _unit_holding(module: nn.Module) -> Optional[Unit]:
    for param in module._parameters.values():
        if param is not None:
            owner = owner_of(param)
            if owner is not None:
                return owner.unit
    return None


def _allocate(module: nn.Module, table: dict, name: str, tensor: torch.Tensor,
              device: torch.device) -> torch.Tensor:
    """A meta parameter's data (identity kept) or buffer, allocated on ``device``."""
    fresh = torch.empty_like(tensor, device=device)
    if isinstance(tensor, nn.Parameter):  # no `.data =` on meta
        torch.utils.swap_tensors(tensor, nn.Parameter(fresh, requires_grad=tensor.requires_grad))
        return tensor
    table[name] = fresh
    return fresh
