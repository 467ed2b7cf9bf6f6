"""What a unit's data collectives may replace (FSDP2's module setters
``set_custom_all_gather``, ``set_custom_reduce_scatter``,
``set_all_reduce_hook``, ``set_requires_all_reduce``,
``set_separate_reduce_scatter_group``): one :class:`UnitComms` per unit that
changed any of them, shared by every flat buffer of the unit
(``FlatBuffer.comms``; ``None``, the default, is the plain path of
``runtime/collective_queue.py`` and costs nothing).

[Note: custom collectives]
A custom all-gather or reduce-scatter is an object with torch FSDP2's
``Comm`` protocol (``torch.distributed.fsdp``'s ``AllGather`` and
``ReduceScatter``):

* ``allocate(size, *, dtype, device) -> Tensor``: the memory the
  collective reads and writes; the queue asks it for the all-gather's
  output and for the reduce-scatter's input and output, never frees what
  it returned (the object may keep and reuse it), and copies out of it
  after the wait, so nothing it allocated outlives the wait as a
  parameter or a gradient.
* ``__call__(output_tensor, input_tensor, group, [op,] async_op)``: issue
  it on the process group; returns a work (waited later) or ``None``
  (finished already).

Every all-gather and reduce-scatter of the unit goes through it, a
bucket's included (the bucket plan only joins units whose ``UnitComms``
have the same :meth:`UnitComms.key`). It costs one copy per collective
(the all-gather cannot write straight into the unsharded buffer, the
reduce-scatter cannot read straight from the flat gradient).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .collectives import reduce_op
from .groups import ShardGroup

AllReduceHook = Callable[[torch.Tensor], None]


class UnitComms:
    """The replaced parts of one unit's collectives.

    Attributes:
        all_gather: a custom all-gather (``None``: the library's).
        reduce_scatter: a custom reduce-scatter (``None``: the library's).
        all_reduce_hook: called with each reduction's output before it is
            folded into the sharded gradient: the reduce-scatter's under
            FSDP, the replica all-reduce's under hybrid sharding; it may
            change it in place. It sees the sum where the reduction divides
            locally afterwards (``set_gradient_divide_factor``,
            ``force_sum``), the mean where the collective averaged.
        requires_all_reduce: hybrid sharding only: ``False`` keeps the
            reduce-scatter's output (summed over the backwards) instead of
            all-reducing it over the replicas; the next reduction with
            ``True`` all-reduces the sum.
        reduce_scatter_group: a second process group over the same ranks as
            the shard group, for the reduce-scatters (``None``: the shard
            group's).
    """

    __slots__ = ("all_gather", "reduce_scatter", "all_reduce_hook", "requires_all_reduce",
                 "reduce_scatter_group")

    def __init__(self) -> None:
        self.all_gather: Optional[object] = None
        self.reduce_scatter: Optional[object] = None
        self.all_reduce_hook: Optional[AllReduceHook] = None
        self.requires_all_reduce: bool = True
        self.reduce_scatter_group: Optional[dist.ProcessGroup] = None

    def key(self) -> tuple:
        """What two units must share to be bucketed together."""
        return (id(self.all_gather), id(self.reduce_scatter), id(self.all_reduce_hook),
                self.requires_all_reduce, id(self.reduce_scatter_group))

    def reduce_group(self, group: ShardGroup) -> ShardGroup:
        """``group`` with the reduce-scatter's process group."""
        separate = self.reduce_scatter_group
        if separate is None:
            return group
        return dataclasses.replace(group, _process_group=weakref.ref(separate))


def allocate(comm: object, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat tensor of ``numel`` elements from ``comm``'s allocator."""
    tensor = comm.allocate((numel,), dtype=dtype, device=device)  # type: ignore[attr-defined]
    if tensor.numel() != numel or tensor.dtype != dtype:
        raise ValueError(
            f"{type(comm).__name__}.allocate(({numel},), dtype={dtype}) returned a tensor of "
            f"{tensor.numel()} elements of {tensor.dtype}; it must return exactly that")
    return tensor.view(-1)


def all_gather_custom(comm: object, output: torch.Tensor, shard: torch.Tensor,
                      group: ShardGroup) -> object:
    """Issue ``comm``'s all-gather of ``shard`` into ``output``; a work to wait."""
    work = comm(output, shard, group.process_group, async_op=True)  # type: ignore[operator]
    return _Finished() if work is None else work


def reduce_scatter_custom(comm: object, output: torch.Tensor, flat: torch.Tensor,
                          group: ShardGroup, divide_factor: Optional[float],
                          force_sum: bool) -> object:
    """Issue ``comm``'s reduce-scatter of ``flat`` into ``output`` with the
    op the library's own would use (``SUM`` or ``AVG``, see
    ``comm/collectives.needs_post_division``); a work to wait."""
    op = reduce_op(group, divide_factor, force_sum)
    work = comm(output, flat, group.process_group, op, async_op=True)  # type: ignore[operator]
    return _Finished() if work is None else work


class _Finished:
    """The work of a custom collective that returned ``None`` (done)."""

    def wait(self, timeout: object = None) -> bool:
        return True
