"""The module methods that end a step's gradient reduction by hand and keep
unsharded storage (FSDP2 2.15's three, on every supported torch), and the
pending gradients beyond FSDP2; mixed into :class:`ShardedModule`.
"""

from __future__ import annotations

from typing import Optional

import torch

from .manual_finalization import (
    GradientReductionHandle, check_root_between_backwards, finalize_backward,
    pending_gradients, synchronize_gradients)
from ..runtime.state import own_state, states_at


class ShardedFinalizationMethods:
    """The finalization and storage methods of :class:`ShardedModule`."""

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """With ``True``, no backward ends the step: reductions stay in flight
        until :meth:`finalize_backward` ([Note: manual finalization]); for
        pipeline schedules and CUDA-graph capture. On the root, between
        backwards, on every rank; ``RuntimeError`` when changed while a
        finalization is pending."""
        state = own_state(self)
        context = check_root_between_backwards(state, "set_manual_backward_finalization")
        if context is not None and context.finalization_pending and \
                bool(enabled) != context.settings.manual_finalization:
            raise RuntimeError(
                f"set_manual_backward_finalization on {state.unit.name} cannot change mode "
                "after backward starts: call finalize_backward() first (or reset_iter_state()).")
        state.change_model_setting("manual_finalization", bool(enabled))

    def finalize_backward(self, *, async_op: bool = False) -> Optional[GradientReductionHandle]:
        """Complete every reduction of the step's backwards and publish ``.grad``
        ([Note: manual finalization]). With ``async_op=True``, return a
        :class:`GradientReductionHandle` to ``wait()`` on before reading the
        gradients; else ``None``. On the root, after the step's last backward, on
        every rank. ``RuntimeError`` without
        ``set_manual_backward_finalization(True)`` or while the previous handle
        is not waited."""
        context = check_root_between_backwards(own_state(self), "finalize_backward")
        if context is None:  # no forward yet: nothing to finalize (as FSDP2)
            return GradientReductionHandle() if async_op else None
        return finalize_backward(context, bool(async_op))

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """With ``True``, each unit keeps its unsharded storage across reshard, so
        every unshard writes the same memory (stable data pointers for CUDA-graph
        capture) at the cost of the unsharded size for the whole run (``describe()``
        shows it). ``False`` frees it at the next reshard."""
        for state in states_at(self, recurse):
            for buffer in state.unit.buffers:
                buffer.keep_unsharded_storage(bool(keep))

    def get_pending_gradients(self) -> dict[str, torch.Tensor]:
        """By FQN, this subtree's gradients not yet reduced, writable in place
        without communication ([Note: pending gradients]). Between backwards."""
        return pending_gradients([state.unit for state in states_at(self, True)])

    def synchronize_gradients(self) -> None:
        """Reduce every pending gradient of the model now, whatever the sync
        settings, and publish it to ``.grad``. On the root, between backwards, on
        every rank."""
        context = check_root_between_backwards(own_state(self), "synchronize_gradients")
        if context is not None:
            synchronize_gradients(context)

