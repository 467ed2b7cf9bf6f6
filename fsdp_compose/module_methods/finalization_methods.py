"""The module methods that end a step's gradient reduction by hand and keep
unsharded storage: FSDP2 2.15's three (``set_manual_backward_finalization``,
``finalize_backward``, ``set_keep_unsharded_storage``), with its meaning on
every supported torch, and the pending-gradient view beyond FSDP2
(``get_pending_gradients``, ``synchronize_gradients``). Mixed into
:class:`ShardedModule`; each routes to ``manual_finalization.py`` or to
the units.
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
        """With ``True``, no backward ends the step: each one reshards the
        units and leaves its reductions in flight, and
        :meth:`finalize_backward`, after the step's last backward,
        completes them and publishes the gradients ([Note: manual
        finalization] in ``module_methods/manual_finalization.py``). For pipeline
        schedules and CUDA-graph capture (FSDP2 2.15's method). On the root
        only, between backwards; every rank alike."""
        state = own_state(self)
        context = check_root_between_backwards(state, "set_manual_backward_finalization")
        if context is not None and context.finalization_pending and \
                bool(enabled) != context.settings.manual_finalization:
            raise RuntimeError(
                f"set_manual_backward_finalization on {state.unit.name} cannot change mode "
                "after backward starts: call finalize_backward() first (or reset_iter_state()).")
        state.change_model_setting("manual_finalization", bool(enabled))

    def finalize_backward(self, *, async_op: bool = False) -> Optional[GradientReductionHandle]:
        """Complete every reduction and reshard of the step's backwards and
        publish the gradients to ``.grad``. Under hybrid sharding this is
        also where the replica all-reduce deferred by
        ``set_requires_all_reduce(False)`` runs, once for the step (beyond
        FSDP2, which refuses it). With ``async_op=True`` it returns at once
        a :class:`GradientReductionHandle`: ``wait()`` on it before reading
        the gradients or stepping the optimizer (its ``wait()`` does
        nothing when there was nothing to finalize: before the first
        forward, or no backward since the last finalization). Without
        ``async_op``, ``None``. On the root only, after the step's last
        backward, on every rank; ``RuntimeError`` without
        ``set_manual_backward_finalization(True)`` or while the previous
        handle is not waited (as FSDP2)."""
        context = check_root_between_backwards(own_state(self), "finalize_backward")
        if context is None:  # no forward yet: nothing to finalize (as FSDP2)
            return GradientReductionHandle() if async_op else None
        return finalize_backward(context, bool(async_op))

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """With ``True``, each unit keeps its unsharded storage across
        reshard and unshard: the parameters are sharded again between uses
        (the module attributes hold the shards), but the memory is never
        given back, and every unshard writes the same storage, so the
        unsharded parameters have the same data pointers in every
        iteration (CUDA-graph capture). Costs the unsharded size of every
        such unit for the whole run (``describe()`` shows it per unit).
        ``False`` frees it at the next reshard (now, if sharded)."""
        for state in states_at(self, recurse):
            for buffer in state.unit.buffers:
                buffer.keep_unsharded_storage(bool(keep))

    def get_pending_gradients(self) -> dict[str, torch.Tensor]:
        """Beyond FSDP2: by FQN, the gradients of this module's subtree not
        yet reduced, readable and writable in place, without communication
        ([Note: pending gradients]): a gradient kept by
        ``set_requires_gradient_sync(False)`` is this rank's full-shape
        sum over its micro-batches; one kept by
        ``set_requires_all_reduce(False)`` (hybrid sharding) is this rank's
        piece of its replica's sum, shaped like its ``.grad``. Changes are
        what the next reduction reduces; ``zero_grad`` drops them.
        Between backwards."""
        return pending_gradients([state.unit for state in states_at(self, True)])

    def synchronize_gradients(self) -> None:
        """Beyond FSDP2: reduce every pending gradient of the model now
        (whatever the sync settings) and publish it to ``.grad``, as the
        end of a last backward would. On the root, between backwards, on
        every rank."""
        context = check_root_between_backwards(own_state(self), "synchronize_gradients")
        if context is not None:
            synchronize_gradients(context)

