"""Collectives over a unit's :class:`ShardGroup`; they never copy their inputs.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .watched_wait import wait_watched
from .groups import ShardGroup

# torch >= 2.10: *_single.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _DoneWork:

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        return True


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group: ShardGroup,
                    async_op: bool = False) -> Optional[dist.Work]:
    """Rank-major; the work when ``async_op``."""
    if group.world_size == 1:
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard)
        return _DoneWork() if async_op else None
    return all_gather_flat(output, shard, group=group.process_group, async_op=async_op)


def reduce_scatter_scaled(output: torch.Tensor, flat: torch.Tensor, group: ShardGroup,
                          divide_factor: Optional[float] = None, force_sum: bool = False,
                          async_op: bool = False) -> Optional[dist.Work]:
    """With :func:`all_reduce_replicas` and :func:`finish_scaling`: the mean, or the sum
    divided by ``divide_factor``."""
    if group.world_size == 1:
        if output.data_ptr() != flat.data_ptr():
            output.copy_(flat)
        return _DoneWork() if async_op else None
    op = reduce_op(group, divide_factor, force_sum)
    if _GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE and flat.device.type == "cpu" and \
            dist.get_backend(group.process_group) == "gloo":
        work = dist.all_reduce(flat, op=op, group=group.process_group, async_op=True)
        chunk = flat.narrow(0, group.rank * output.numel(), output.numel())
        pending = _ChunkAfterAllReduce(work, output, chunk)
        if async_op:
            return pending
        pending.wait()
        return None
    return _reduce_scatter_flat(output, flat, op=op, group=group.process_group,
                                async_op=async_op)


# [Note: gloo reduce-scatter as an all-reduce]
# Gloo's reduce-scatter copies its input: an in-place all-reduce and a copy of this rank's chunk
# is faster and bit-identical.
_GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE = True


def set_gloo_reduce_scatter_via_all_reduce(enabled: bool) -> bool:
    """Returns the previous setting (default ``True``)."""
    global _GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE
    previous, _GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE = _GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE, bool(enabled)
    return previous


def gloo_reduce_scatter_via_all_reduce() -> bool:
    return _GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE


class _ChunkAfterAllReduce:

    def __init__(self, work: dist.Work, output: torch.Tensor, chunk: torch.Tensor) -> None:
        self._work: Optional[dist.Work] = work
        self._output = output
        self._chunk = chunk

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if self._work is None:
            return True  # waited already
        if timeout is None:
            self._work.wait()
        else:
            self._work.wait(timeout)
        self._work = None
        self._output.copy_(self._chunk)
        return True


def all_reduce_replicas(output: torch.Tensor, group: ShardGroup,
                        divide_factor: Optional[float] = None, force_sum: bool = False,
                        async_op: bool = False) -> Optional[dist.Work]:
    """Across the replicas."""
    replicate = group.replicate_process_group
    if replicate is None or group.replicate_size == 1:
        return _DoneWork() if async_op else None
    return dist.all_reduce(output, op=reduce_op(group, divide_factor, force_sum),
                           group=replicate, async_op=async_op)


def finish_scaling(output: torch.Tensor, group: ShardGroup, divide_factor: Optional[float],
                   force_sum: bool) -> None:
    if divide_factor is None and not force_sum:
        return
    if needs_post_division(group, divide_factor, force_sum):
        factor = group.total_size if divide_factor is None else divide_factor
        if factor != 1.0:
            output.div_(factor)


def reduce_op(group: ShardGroup, divide_factor: Optional[float],
              force_sum: bool) -> dist.ReduceOp:
    return dist.ReduceOp.SUM if needs_post_division(group, divide_factor, force_sum) \
        else dist.ReduceOp.AVG


def needs_post_division(group: ShardGroup, divide_factor: Optional[float],
                        force_sum: bool) -> bool:
    mean = divide_factor is None or divide_factor == group.total_size
    return force_sum or not mean


def all_reduce_max(tensor: torch.Tensor, group: ShardGroup) -> None:
    if group.world_size > 1:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group.process_group,
                               async_op=True)
        wait_watched(work, group.process_group)
    replicate = group.replicate_process_group
    if replicate is not None and group.replicate_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=replicate)


def release_after_collective(*tensors: torch.Tensor) -> None:
    """[Note: freeing what a collective read]."""
    for tensor in tensors:
        if tensor.device.type == "cpu":
            tensor.untyped_storage().resize_(0)


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_counts: list[int],
               input_counts: list[int], group: ShardGroup) -> None:
    """``input_counts[j]`` elements to rank ``j``, ``output_counts[j]`` from it."""
    if group.world_size == 1:
        output.copy_(input)
        return
    dist.all_to_all_single(output, input, output_split_sizes=output_counts,
                           input_split_sizes=input_counts, group=group.process_group)
