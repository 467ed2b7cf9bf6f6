"""Refuse ``optimizer.step()`` over sharded parameters whose gradients are
not ready (it would silently apply stale or missing gradients). The state
read is equal on every rank, so every rank raises together, before any
collective.
"""

from __future__ import annotations

import weakref

from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._torch_private import current_graph_task_id
from ..buffers.flat_buffer import FlatBuffer
from ..runtime.owners import owner_of
from ..runtime.training_state import TrainingState
from ..runtime.unit import Unit

_installed: list[object] = []
_buffers_of: "weakref.WeakKeyDictionary[Optimizer, tuple[int, list[weakref.ref[Unit]], list[FlatBuffer]]]" \
    = weakref.WeakKeyDictionary()
"""Per optimizer: its parameter count when last looked at, and (unit
weakly, buffer index) of each buffer holding its parameters. Weak, so the
cache never keeps a dropped model alive past one ``gc.collect()``."""


def install_step_guard() -> None:
    if not _installed:
        _installed.append(register_optimizer_step_pre_hook(_check_step))


def _managed_buffers(optimizer: Optimizer) -> list[tuple[Unit, FlatBuffer]]:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    cached = _buffers_of.get(optimizer)
    if cached is None or cached[0] != count:
        found: dict[int, tuple[Unit, int]] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                entry = owner_of(param)
                if entry is not None:
                    found.setdefault(id(entry.buffer),
                                     (entry.unit, entry.unit.buffers.index(entry.buffer)))
        cached = _buffers_of[optimizer] = (
            count, [weakref.ref(unit) for unit, _ in found.values()],
            [index for _, index in found.values()])
    _, units, indices = cached
    managed = []
    for unit_ref, index in zip(units, indices):
        unit = unit_ref()
        if unit is not None:  # else its model was dropped
            managed.append((unit, unit.buffers[index]))
    return managed


def _check_step(optimizer: Optimizer, args: tuple, kwargs: dict) -> None:
    in_backward = current_graph_task_id() != -1  # e.g. optimizer in backward hooks
    # step(closure) (LBFGS) makes the gradients inside step(), after this
    # hook: only the units' states can be checked now
    gradients_come_later = kwargs.get("closure", args[1] if len(args) > 1 else None) is not None
    for unit, buffer in _managed_buffers(optimizer):
        fqn = buffer.records[0].fqn
        if unit.training_state is TrainingState.FORWARD or (unit.training_state is not TrainingState.IDLE
                                                   and not in_backward):
            raise RuntimeError(
                f"optimizer.step() while {unit.name} (parameter '{fqn}') is in its "
                f"{unit.training_state.name.lower()}: step after backward has finished. If a forward or "
                "backward raised, call reset_iter_state() on the root module first.")
        if gradients_come_later:
            continue
        if buffer.grad.has_unpublished:
            raise RuntimeError(
                f"optimizer.step() while the reduce-scatter of {unit.name}'s gradients "
                f"(parameter '{fqn}') is still pending: the last backward ran with "
                "set_is_last_backward(False). Call set_is_last_backward(True) on the root "
                "before the step's last backward.")
        if buffer.grad.has_unreduced:
            raise RuntimeError(
                f"optimizer.step() while {unit.name}'s gradients (parameter '{fqn}') are not "
                "reduced across ranks: the last backward ran with "
                "set_requires_gradient_sync(False). Call set_requires_gradient_sync(True) before "
                "the step's last backward.")
