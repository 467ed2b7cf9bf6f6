"""The caller ends the step's gradient reduction: manual backward
finalization, the deferred replica all-reduce, and the pending gradients
read between micro-batches.

[Note: manual finalization]
With ``set_manual_backward_finalization(True)`` on the root, every backward
ends as under ``set_is_last_backward(False)``: units reshard, reductions stay
in flight, nothing reaches ``.grad``. ``finalize_backward()``, on every rank
at the same point, waits the reduce-scatters, issues per buffer the one
replica all-reduce that ``set_requires_all_reduce(False)`` deferred, and
then (at once, or at the returned handle's ``wait()``) publishes the
gradients and ends the step. With no backward since the last finalization
it does nothing.

[Note: pending gradients]
Between a step's backwards the unreduced gradients are readable and
writable in place, without communication: one kept by
``set_requires_gradient_sync(False)`` is this rank's full-shape sum over its
micro-batches; one kept by ``set_requires_all_reduce(False)`` is this rank's
reduce-scattered piece, not yet all-reduced over replicas.
``synchronize_gradients`` reduces and publishes both; ``zero_grad`` drops
both.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .._torch_private import current_graph_task_id
from ..buffers.flat_buffer import FlatBuffer
from ..runtime.end_of_backward import end_step, finish_reductions
from ..runtime.state import FullyShardState, ModelContext
from ..runtime.training_state import TrainingState
from ..runtime.unit import Unit


class GradientReductionHandle:
    """Returned by ``finalize_backward(async_op=True)``. ``wait()``, on every
    rank, completes the reductions and publishes ``.grad``; a second
    ``wait()`` does nothing; ``RuntimeError`` if ``reset_iter_state()``
    dropped the reductions since."""

    def __init__(self, context: Optional[ModelContext] = None,
                 complete: Optional[Callable[[], None]] = None) -> None:
        self._context: Optional[ModelContext] = context
        self._complete: Optional[Callable[[], None]] = complete
        """``None``: nothing to do."""

    def wait(self) -> None:
        context, complete = self._context, self._complete
        if context is None or complete is None:
            return  # waited already, or nothing was in flight
        if context.pending_reduction is not self:
            raise RuntimeError("This gradient reduction handle was invalidated: "
                               "reset_iter_state() dropped its reductions")
        self._context = self._complete = None
        context.pending_reduction = None
        complete()


def check_root_between_backwards(state: FullyShardState, method: str) -> Optional[ModelContext]:
    """``state``'s model (``None`` before the first forward); raises, on every
    rank alike, unless called on the root outside backward."""
    unit, context = state.unit, state.context
    if context is None:
        if state.annotated_parent is not None:
            raise RuntimeError(
                f"{method} was called on {unit.name}, which is not the root module (an "
                "annotated module above it is): call it on the root module, the one annotated "
                "last.")
        return None
    if context.root is not state:
        raise RuntimeError(
            f"{method} was called on {unit.name}, which is not the root; call it on the root "
            f"module, {context.root.unit.name}.")
    busy = [s.unit for s in context.states if s.unit.training_state in
            (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)]
    if context.backward_callback_queued or busy or current_graph_task_id() != -1:
        raise RuntimeError(
            f"{method} was called on {unit.name} during backward"
            + (f" ({busy[0].name} is in {busy[0].training_state.name})" if busy else "")
            + ": call it between backward passes, after the step's last backward returned.")
    return context


def finalize_backward(context: ModelContext, async_op: bool) -> Optional[GradientReductionHandle]:
    """[Note: manual finalization]: a handle with ``async_op``, else ``None``."""
    if not context.settings.manual_finalization:
        raise RuntimeError(
            f"finalize_backward on {context.root.unit.name} requires manual backward "
            "finalization: call set_manual_backward_finalization(True) on it before forward.")
    if context.pending_reduction is not None:
        raise RuntimeError(
            f"finalize_backward on {context.root.unit.name}: the previous gradient reduction "
            "must be waited on before finalizing backward again (call wait() on the handle "
            "the last finalize_backward(async_op=True) returned).")
    if not context.finalization_pending:
        return GradientReductionHandle() if async_op else None  # no backward since the last
    context.finalization_pending = False
    units = [state.unit for state in context.states]
    collectives = context.collectives
    collectives.finish_reduces()
    for unit in units:
        for buffer in unit.trainable_buffers:
            collectives.all_reduce_held(buffer, unit.settings.reduce_options)
    order = context.prefetch_order
    forward_order = order.forward_order or order.previous_forward_order

    def complete() -> None:
        finish_reductions(units, collectives)
        end_step(collectives, forward_order)
        after = context.settings.after_last_backward
        if after is not None:
            after(context.root.unit.modules[0])

    handle = GradientReductionHandle(context, complete)
    context.pending_reduction = handle
    if async_op:
        return handle
    handle.wait()
    return None


def synchronize_gradients(context: ModelContext) -> None:
    """Reduce every pending gradient now and publish it to ``.grad``, whatever
    the units' sync settings."""
    units = [state.unit for state in context.states]
    collectives = context.collectives
    previous = [unit.settings.requires_gradient_sync for unit in units]
    for unit in units:  # a bucket carries the buffers of syncing units only
        unit.settings.change("requires_gradient_sync", True)
    try:
        for unit in units:
            options = unit.settings.reduce_options
            for buffer in unit.trainable_buffers:
                if buffer.grad.has_unreduced:
                    collectives.reduce(buffer, options)
        collectives.flush_held_reduces()
    finally:
        for unit, sync in zip(units, previous):
            unit.settings.change("requires_gradient_sync", sync)
    collectives.finish_reduces()
    for unit in units:
        for buffer in unit.trainable_buffers:
            collectives.all_reduce_held(buffer, unit.settings.reduce_options)
    finish_reductions(units, collectives)
    context.finalization_pending = False


def pending_gradients(units: list[Unit]) -> dict[str, torch.Tensor]:
    """[Note: pending gradients], by FQN; parameters without one are left out.
    Writes to the views count (a ``ShardDim(d)``, ``d > 0``, parameter's
    unreduced one is a copy)."""
    out: dict[str, torch.Tensor] = {}
    for unit in units:
        for buffer in unit.trainable_buffers:
            unreduced, partial = buffer.grad.pending_unreduced(), buffer.grad.pending_partial()
            if unreduced is not None and partial is not None:
                raise RuntimeError(
                    f"get_pending_gradients on {unit.name}: the gradients of "
                    f"{buffer.records[0].fqn} (and the rest of its buffer) are both unreduced "
                    "(set_requires_gradient_sync(False)) and partly reduced "
                    "(set_requires_all_reduce(False)); read them after a backward with "
                    "gradient sync, or call synchronize_gradients() first.")
            views = _views(buffer, unreduced, partial)
            for record, view in zip(buffer.records, views):
                if view is not None:
                    out[record.fqn] = view
    return out


def _views(buffer: FlatBuffer, unreduced: Optional[torch.Tensor],
           partial: Optional[torch.Tensor]) -> list[Optional[torch.Tensor]]:
    if unreduced is not None:
        return list(buffer.full_views(unreduced))
    if partial is not None:
        return list(buffer.local_views(partial))
    return [None] * len(buffer.records)


def drop_pending_gradients(units: list[Unit]) -> None:
    """``zero_grad``: forget the gradients not yet reduced."""
    for unit in units:
        for buffer in unit.trainable_buffers:
            buffer.grad.drop_pending()
