"""How a unit's transitions happen: through the collective queue, or in
place where nothing crosses ranks. The model's path is chosen once
(:func:`choose_path`), so ``Unit`` and ``CollectiveQueue`` never ask how
many ranks there are.

[Note: the local path]
A model whose every buffer is aliased (one rank), with no assembled
copies, replica or custom collectives, communicates and frees nothing.
:class:`LocalPath` runs its transitions in place: unshard swaps the views
in, nothing is fetched ahead; the end of forward leaves the views; units
other than the root whose buffers all train and which do not defer their
reduction get no pre-backward hook (their first gradient queues the end of
backward; a manual ``reshard()`` has backward's first event swap the views
back); a reduction folds at once (``fold_unreduced``). Every other model
takes :class:`CollectivePath`. The path is chosen again when a buffer is
rebuilt or a unit's collectives are replaced.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch.autograd.graph import register_multi_grad_hook

from .._torch_private import current_graph_task_id
from ..buffers.flat_buffer import FlatBuffer
from ..buffers.flat_grad import ReduceOptions
from ..comm.groups import ShardGroup
from .collective_queue import CollectiveQueue
from .training_state import TrainingState
from .protocols import PathOrder, PathUnit

_BACKWARD = (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)


class CollectivePath:
    """Every transition through the model's collective queue."""

    __slots__ = ("queue",)

    def __init__(self, queue: CollectiveQueue) -> None:
        self.queue: CollectiveQueue = queue

    def unshard(self, unit: PathUnit) -> None:
        self.queue.gather(unit, (), unit.prefetch_order.ran)

    def gather_for_forward(self, unit: PathUnit) -> None:
        order = unit.prefetch_order
        self.queue.gather(unit, order.record_forward(unit), order.ran)

    def gather_for_backward(self, unit: PathUnit) -> None:
        """Its targets too, unless ``reduce_scatter_unused_params``."""
        order = unit.prefetch_order
        targets: Optional[Sequence[Any]] = ()
        if not unit.settings.reduce_scatter_unused_params:
            plan = order.backward_plan
            targets = plan.get(id(unit)) if plan is not None else None
            if targets is None:  # no plan
                targets = order.backward_targets(unit)
        self.queue.gather(unit, targets, order.ran)

    def plan_backward(self, order: PathOrder) -> None:
        """The root's forward ended: plan the backward's prefetch targets."""
        order.plan_backward()

    def start_forward(self, unit: PathUnit, frozen: bool) -> None:
        unit.backward_without_hook = False

    def hook_outputs(self, unit: PathUnit, tensors: Sequence[torch.Tensor],
                     pre_backward: Callable[[Any], None]) -> None:
        """``pre_backward`` when backward reaches any of ``tensors``."""
        if len(tensors) == 1:  # no multi-grad bookkeeping
            _on_gradient(tensors[0], pre_backward)
        else:
            register_multi_grad_hook(tensors, pre_backward, mode="any")

    def reshard_after_forward(self, unit: PathUnit, keep: Optional[ShardGroup]) -> None:
        for buffer in unit.buffers:
            if buffer.is_gathering:
                self.queue.wait_gather(buffer)
            buffer.reshard(keep_for_backward=keep)

    def gradient_ready(self, unit: PathUnit) -> None:
        """A buffer's flat gradient is complete."""

    def reduce(self, buffer: FlatBuffer, options: ReduceOptions) -> None:
        self.queue.reduce(buffer, options)

    def in_backward(self, unit: PathUnit) -> bool:
        """A forward now is a recomputation."""
        return unit.training_state in _BACKWARD

    def backward_pending_without_hook(self, unit: PathUnit) -> bool:
        return False


class LocalPath(CollectivePath):
    """[Note: the local path]. Stateless but for the queue."""

    __slots__ = ()

    def unshard(self, unit: PathUnit) -> None:
        for buffer in unit.buffers:
            if not buffer.is_unsharded:
                buffer.unshard_in_place()

    def gather_for_forward(self, unit: PathUnit) -> None:
        unit.prefetch_order.record_forward(unit, fetch_ahead=False)
        self.unshard(unit)

    def gather_for_backward(self, unit: PathUnit) -> None:
        self.unshard(unit)

    def plan_backward(self, order: PathOrder) -> None:
        pass

    def start_forward(self, unit: PathUnit, frozen: bool) -> None:
        """Frozen buffers keep the hook."""
        unit.backward_without_hook = not frozen and not unit.is_root and \
            not unit.settings.reduce_scatter_unused_params

    def hook_outputs(self, unit: PathUnit, tensors: Sequence[torch.Tensor],
                     pre_backward: Callable[[Any], None]) -> None:
        if not unit.backward_without_hook:
            super().hook_outputs(unit, tensors, pre_backward)

    def reshard_after_forward(self, unit: PathUnit, keep: Optional[ShardGroup]) -> None:
        """Nothing: a reshard frees nothing."""

    def gradient_ready(self, unit: PathUnit) -> None:
        if unit.backward_without_hook:
            unit.backward_started()  # no pre-backward hook ran

    def reduce(self, buffer: FlatBuffer, options: ReduceOptions) -> None:
        buffer.grad.fold_unreduced(options)

    def in_backward(self, unit: PathUnit) -> bool:
        """A backward runs on this thread."""
        return unit.training_state in _BACKWARD or \
            (unit.backward_without_hook and current_graph_task_id() != -1)

    def backward_pending_without_hook(self, unit: PathUnit) -> bool:
        """A recorded backward has not reached the hookless unit yet."""
        return unit.backward_without_hook and unit.training_state is TrainingState.IDLE and \
            any(buffer.grad.saw_forward for buffer in unit.buffers)


def choose_path(queue: CollectiveQueue, buffers: Sequence[FlatBuffer]) -> CollectivePath:
    """[Note: the local path]."""
    local = bool(buffers) and all(
        b.reshard_frees_nothing and b.group.total_size == 1 and b.comms is None for b in buffers)
    return LocalPath(queue) if local else CollectivePath(queue)


def _on_gradient(tensor: torch.Tensor, hook: Callable[[Any], None]) -> None:
    """``hook`` when backward reaches ``tensor``'s gradient."""
    node = tensor.grad_fn
    if node is not None:
        node.register_prehook(hook)
    else:
        tensor.register_hook(hook)
