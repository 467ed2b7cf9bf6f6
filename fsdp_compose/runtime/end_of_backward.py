"""The end of backward, model-wide: deferred reductions, waits, publication.
Units come in state-list order (the same on every rank).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from .._torch_private import post_accumulate_grad_hooks, post_accumulate_grad_hooks_or_none
from ..buffers.flat_buffer import FlatBuffer
from ..comm.wire import all_reduce_max, release_after_collective
from .collective_queue import CollectiveQueue
from .unit import Unit


def finish_backward(units: Sequence[Unit], collectives: CollectiveQueue,
                    forward_order: Sequence[Unit], is_last_backward: bool) -> None:
    """Post-condition: every unit IDLE; after the last backward every
    gradient is published."""
    collectives.flush_held_reduces()
    reduce_deferred(units, collectives)
    if is_last_backward:
        finish_reductions(units, collectives)
    for unit in units:
        unit.finish_backward()
    if is_last_backward:
        end_step(collectives, forward_order)


def finish_reductions(units: Sequence[Unit], collectives: CollectiveQueue) -> None:
    """Every rank calls it at the same point (a collective)."""
    collectives.finish_reduces()
    collectives.observer.before_publish()
    publish_gradients([b for unit in units for b in unit.buffers], collectives)


def end_step(collectives: CollectiveQueue, forward_order: Sequence[Unit]) -> None:
    """The step's collectives are over."""
    collectives.end_iteration()
    collectives.order_agreed(forward_order)  # the fingerprint check passed


def reduce_deferred(units: Sequence[Unit], collectives: CollectiveQueue) -> None:
    """``reduce_scatter_unused_params``: every trainable buffer, zeros where
    this rank has none, so every rank issues the same reductions."""
    for unit in units:
        if not (unit.settings.reduce_scatter_unused_params and unit.settings.requires_gradient_sync):
            continue
        for buffer in unit.trainable_buffers:
            if not buffer.grad.has_unreduced:
                buffer.unsharded.grad = torch.zeros(
                    buffer.layout.padded_numel, dtype=buffer.compute_dtype,
                    device=buffer.compute_device)
            collectives.reduce(buffer, unit.settings.reduce_options)


def publish_gradients(buffers: Sequence[FlatBuffer], collectives: CollectiveQueue) -> None:
    """Publish ([Note: used parameters]), then run the post-accumulate-grad
    hooks: one all-reduce of the used flags per group ([Note: rank divergence]).
    """
    pending = {id(b) for b in buffers if b.grad.has_unpublished}
    for buffer in buffers:
        if id(buffer) in pending and buffer.grad.is_reducing:
            collectives.settle(buffer)
    observer = collectives.observer
    by_group: dict[int, list[FlatBuffer]] = {}
    for buffer in buffers:
        by_group.setdefault(buffer.group.key, []).append(buffer)
    fresh: list[nn.Parameter] = []
    for group_buffers in by_group.values():
        if not any(id(b) in pending for b in group_buffers):
            continue
        group = group_buffers[0].group
        if group.total_size == 1:
            for buffer in group_buffers:
                if id(buffer) in pending:
                    fresh += buffer.grad.publish(buffer.grad.used)
            continue
        # flags for every buffer: the same size on every rank
        flags = [u for b in group_buffers for u in (
            b.grad.used if id(b) in pending else [False] * len(b.records))]
        extra = observer.payload(group)
        mask = torch.tensor(flags + extra, dtype=torch.uint8, device=group.device)
        all_reduce_max(mask, group)
        values = mask.tolist()
        release_after_collective(mask)
        if extra:
            observer.check(group, values[len(flags):])
        flags = [bool(v) for v in values[:len(flags)]]
        start = 0
        for buffer in group_buffers:
            count = len(buffer.records)
            if id(buffer) in pending:
                fresh += buffer.grad.publish(flags[start:start + count])
            start += count
    for param in filter(post_accumulate_grad_hooks_or_none, fresh):
        for hook in post_accumulate_grad_hooks(param).values():
            hook(param)
