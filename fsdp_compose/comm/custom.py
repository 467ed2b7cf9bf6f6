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
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .wire import Issued, PartialSums, Waitable, Wire, reduce_op
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


class CustomWire(Wire):
    """[Note: custom collectives]; the queue never frees their memory."""

    __slots__ = ("comms", "base")

    def __init__(self, comms: UnitComms, base: Wire) -> None:
        self.comms: UnitComms = comms
        self.base: Wire = base

    def key(self) -> tuple:
        return ("custom", self.comms.key(), self.base.key())

    @property
    def quantizes(self) -> bool:
        return self.base.quantizes

    @property
    def fills_members_at_completion(self) -> bool:
        return self.comms.all_gather is not None or self.base.fills_members_at_completion

    def on_policy(self, policy: Wire) -> Wire:
        return CustomWire(self.comms, policy)

    def subgroup_gather(self) -> Wire:
        return CustomWire(self.comms, self.base.subgroup_gather())

    def gather_memory(self, numel: int, dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.Tensor, bool]:
        comm = self.comms.all_gather
        if comm is None:
            return self.base.gather_memory(numel, dtype, device)
        return allocate(comm, numel, dtype, device), False

    def reduce_memory(self, numel: int, dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.Tensor, bool]:
        comm = self.comms.reduce_scatter
        if comm is None:
            return self.base.reduce_memory(numel, dtype, device)
        return allocate(comm, numel, dtype, device), False

    def reduce_group(self, group: ShardGroup) -> ShardGroup:
        return self.comms.reduce_group(group)

    def all_gather(self, destination: torch.Tensor, shard: torch.Tensor,
                   group: ShardGroup) -> Issued:
        comm = self.comms.all_gather
        if comm is None:
            return self.base.all_gather(destination, shard, group)
        out = allocate(comm, destination.numel(), shard.dtype, destination.device)
        work = all_gather_custom(comm, out, shard, group)
        return Issued(work, group.process_group,  # type: ignore[arg-type]
                      copies=[(destination.view(-1), out)], keep_alive=(shard, out))

    def all_gather_packed(self, rows: Sequence[Optional[torch.Tensor]],
                          shards: Sequence[torch.Tensor], group: ShardGroup) -> Issued:
        if self.comms.all_gather is None:
            return self.base.all_gather_packed(rows, shards, group)
        return super().all_gather_packed(rows, shards, group)

    def _all_gather_flat(self, output: torch.Tensor, packed: torch.Tensor,
                         group: ShardGroup) -> Waitable:
        return all_gather_custom(self.comms.all_gather, output, packed,  # type: ignore[return-value]
                                 group)

    def reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, group: ShardGroup,
                       divide_factor: Optional[float], force_sum: bool) -> Issued:
        comm = self.comms.reduce_scatter
        if comm is None:
            return self.base.reduce_scatter(output, flat, group, divide_factor, force_sum)
        comm_input = allocate(comm, flat.numel(), flat.dtype, flat.device)
        comm_input.copy_(flat)
        comm_output = allocate(comm, output.numel(), flat.dtype, flat.device)
        work = reduce_scatter_custom(comm, comm_output, comm_input, group, divide_factor,
                                     force_sum)
        return Issued(work, group.process_group, copies=[(output, comm_output)],  # type: ignore[arg-type]
                      keep_alive=(comm_input, comm_output))

    def reduce_scatter_packed(self, grads: Sequence[Optional[torch.Tensor]],
                              chunks: Sequence[int], outputs: Sequence[Optional[torch.Tensor]],
                              group: ShardGroup, divide_factor: Optional[float],
                              force_sum: bool) -> Issued:
        if self.comms.reduce_scatter is None:
            return self.base.reduce_scatter_packed(grads, chunks, outputs, group, divide_factor,
                                                   force_sum)
        return super().reduce_scatter_packed(grads, chunks, outputs, group, divide_factor,
                                             force_sum)

    def _reduce_scatter_flat(self, output: torch.Tensor, flat: torch.Tensor, group: ShardGroup,
                             divide_factor: Optional[float], force_sum: bool,
                             segments: Optional[list[int]]) -> Waitable:
        return reduce_scatter_custom(self.comms.reduce_scatter, output, flat,  # type: ignore[return-value]
                                     group, divide_factor, force_sum)

    def replica_input(self, partials: PartialSums, output: torch.Tensor
                      ) -> Optional[torch.Tensor]:
        if not self.comms.requires_all_reduce:
            return None
        return partials.merge_partial(output)

    def before_fold(self, output: torch.Tensor) -> None:
        hook = self.comms.all_reduce_hook
        if hook is not None:
            hook(output)
