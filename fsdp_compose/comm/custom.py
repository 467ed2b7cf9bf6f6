"""What a unit's data collectives may replace (FSDP2's custom comm setters):
one :class:`UnitComms` per unit that set any.

[Note: custom collectives]
A custom all-gather or reduce-scatter follows FSDP2's ``Comm`` protocol:
``allocate(size, *, dtype, device)`` gives the memory it works in, never
freed and copied out of after the wait; ``__call__(output, input, group,
[op,] async_op)`` returns a work or ``None``. Buckets join only units with
equal :meth:`UnitComms.key`.
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
        all_gather, reduce_scatter: custom collectives (``None``: the library's).
        all_reduce_hook: called with each reduction's output before it is
            folded; may change it in place.
        requires_all_reduce: hybrid only: ``False`` defers the replica all-reduce.
        reduce_scatter_group: a process group for the reduce-scatters."""

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
        separate = self.reduce_scatter_group
        if separate is None:
            return group
        return dataclasses.replace(group, _process_group=weakref.ref(separate))


def allocate(comm: object, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = comm.allocate((numel,), dtype=dtype, device=device)  # type: ignore[attr-defined]
    if tensor.numel() != numel or tensor.dtype != dtype:
        raise ValueError(
            f"{type(comm).__name__}.allocate(({numel},), dtype={dtype}) returned a tensor of "
            f"{tensor.numel()} elements of {tensor.dtype}; it must return exactly that")
    return tensor.view(-1)


def all_gather_custom(comm: object, output: torch.Tensor, shard: torch.Tensor,
                      group: ShardGroup) -> object:
    work = comm(output, shard, group.process_group, async_op=True)  # type: ignore[operator]
    return _Finished() if work is None else work


def reduce_scatter_custom(comm: object, output: torch.Tensor, flat: torch.Tensor,
                          group: ShardGroup, divide_factor: Optional[float],
                          force_sum: bool) -> object:
    op = reduce_op(group, divide_factor, force_sum)
    work = comm(output, flat, group.process_group, op, async_op=True)  # type: ignore[operator]
    return _Finished() if work is None else work


class _Finished:

    def wait(self, timeout: object = None) -> bool:
        return True
