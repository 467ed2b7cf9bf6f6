"""Collectives of the training step over a unit's :class:`ShardGroup`.

Everything that talks to ``torch.distributed`` for the data path lives in
this package, so the rest of the library never names a backend. The same
functions run on CPU/gloo and CUDA/NCCL.

The collectives never copy their inputs: the all-gather writes straight into
the caller's unsharded buffer, and the reduce-scatter reads straight from the
caller's flat gradient (on gloo it reduces it in place, see [Note: gloo
reduce-scatter as an all-reduce]).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .watched_wait import wait_watched
from .groups import ShardGroup

# torch >= 2.10 names the flat collectives *_single and deprecates the old names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _DoneWork:
    """What a collective over one rank returns: nothing to wait for."""

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        return True


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group: ShardGroup,
                    async_op: bool = False) -> Optional[dist.Work]:
    """All-gather ``shard`` from every rank into ``output`` (``F`` times its
    size, rank-major). Returns the work handle when ``async_op``. Over one
    rank it is a local copy (none at all when ``output`` is ``shard``)."""
    if group.world_size == 1:
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard)
        return _DoneWork() if async_op else None
    return all_gather_flat(output, shard, group=group.process_group, async_op=async_op)


def reduce_scatter_scaled(output: torch.Tensor, flat: torch.Tensor, group: ShardGroup,
                          divide_factor: Optional[float] = None, force_sum: bool = False,
                          async_op: bool = False) -> Optional[dist.Work]:
    """Reduce-scatter ``flat`` (``F`` times ``output``'s size) over the shard
    group: this rank's chunk of the sum (or, for the mean, of the average)
    lands in ``output``.

    The gradient is complete after :func:`all_reduce_replicas` (hybrid
    sharding) and :func:`finish_scaling`: the mean over all ``R * F`` ranks
    when ``divide_factor`` is ``None`` (one ``AVG`` collective per group
    unless ``force_sum``), else the sum divided by ``divide_factor``. Over
    one rank nothing is communicated.
    """
    if group.world_size == 1:
        if output.data_ptr() != flat.data_ptr():
            output.copy_(flat)
        return _DoneWork() if async_op else None
    op = reduce_op(group, divide_factor, force_sum)
    if _GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE and flat.device.type == "cpu" and \
            dist.get_backend(group.process_group) == "gloo":
        # see [Note: gloo reduce-scatter as an all-reduce]
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
# Gloo's reduce-scatter copies its whole input into a buffer of its own (an
# extra unsharded-gradient-sized allocation per reduction in flight) and is
# slower than an in-place all-reduce of the same buffer. On CPU gloo groups
# the reduce-scatter is therefore an all-reduce of the flat gradient in
# place, after which this rank's chunk is copied out: bit-identical to
# gloo's reduce-scatter (both sum in rank order); the flat gradient is the
# caller's to discard. NCCL's reduce-scatter does not copy, so CUDA keeps
# it. Turned off with set_gloo_reduce_scatter_via_all_reduce(False).
_GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE = True


def set_gloo_reduce_scatter_via_all_reduce(enabled: bool) -> bool:
    """Whether gradient reductions over CPU/gloo groups all-reduce the flat
    gradient in place and keep this rank's chunk (default ``True``, same
    values, faster and without gloo's copy of the input) instead of calling
    gloo's reduce-scatter. Process-wide; affects reductions issued after
    the call. Returns the previous setting."""
    global _GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE
    previous, _GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE = _GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE, bool(enabled)
    return previous


def gloo_reduce_scatter_via_all_reduce() -> bool:
    """The current setting of :func:`set_gloo_reduce_scatter_via_all_reduce`."""
    return _GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE


class _ChunkAfterAllReduce:
    """The work of a reduce-scatter done as an all-reduce: waiting on it
    waits the all-reduce, then copies this rank's chunk into the output."""

    def __init__(self, work: dist.Work, output: torch.Tensor, chunk: torch.Tensor) -> None:
        self._work: Optional[dist.Work] = work
        self._output = output
        self._chunk = chunk

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if self._work is None:
            return True  # waited already: the chunk was copied
        if timeout is None:
            self._work.wait()
        else:
            self._work.wait(timeout)  # raises if it runs out: the chunk is copied at a later wait
        self._work = None
        self._output.copy_(self._chunk)
        return True


def all_reduce_replicas(output: torch.Tensor, group: ShardGroup,
                        divide_factor: Optional[float] = None, force_sum: bool = False,
                        async_op: bool = False) -> Optional[dist.Work]:
    """Hybrid sharding: all-reduce a reduce-scattered chunk across the
    replicas (same op as the reduce-scatter). A no-op without replicas."""
    replicate = group.replicate_process_group
    if replicate is None or group.replicate_size == 1:
        return _DoneWork() if async_op else None
    return dist.all_reduce(output, op=reduce_op(group, divide_factor, force_sum),
                           group=replicate, async_op=async_op)


def finish_scaling(output: torch.Tensor, group: ShardGroup, divide_factor: Optional[float],
                   force_sum: bool) -> None:
    """The local division that completes the reduction (a no-op when the
    collectives averaged already)."""
    if divide_factor is None and not force_sum:
        return  # the mean, taken by the collective (needs_post_division, without its calls)
    if needs_post_division(group, divide_factor, force_sum):
        factor = group.total_size if divide_factor is None else divide_factor
        if factor != 1.0:
            output.div_(factor)


def reduce_op(group: ShardGroup, divide_factor: Optional[float],
              force_sum: bool) -> dist.ReduceOp:
    """``AVG`` where the collective can divide, else ``SUM`` (divided after)."""
    return dist.ReduceOp.SUM if needs_post_division(group, divide_factor, force_sum) \
        else dist.ReduceOp.AVG


def needs_post_division(group: ShardGroup, divide_factor: Optional[float],
                        force_sum: bool) -> bool:
    """Whether the reduction sums (and :func:`finish_scaling` divides
    afterwards) rather than averaging over the group in the collective."""
    mean = divide_factor is None or divide_factor == group.total_size
    return force_sum or not mean


def all_reduce_max(tensor: torch.Tensor, group: ShardGroup) -> None:
    """In-place element-wise maximum over every rank of ``group``'s mesh
    (the shard group, then the replicas)."""
    if group.world_size > 1:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group.process_group,
                               async_op=True)
        wait_watched(work, group.process_group)
    replicate = group.replicate_process_group
    if replicate is not None and group.replicate_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=replicate)


def release_after_collective(*tensors: torch.Tensor) -> None:
    """Free the memory of CPU tensors that a finished collective read or
    wrote and that nothing reads any more: gloo's worker thread may hold
    them long after the collective, into later steps ([Note: freeing what
    a collective read] in ``runtime/collective_queue.py``), so the memory
    the process holds would depend on thread scheduling. On an accelerator
    the caching allocator frees them in stream order."""
    for tensor in tensors:
        if tensor.device.type == "cpu":
            tensor.untyped_storage().resize_(0)


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_counts: list[int],
               input_counts: list[int], group: ShardGroup) -> None:
    """Rank ``r`` sends ``input_counts[j]`` consecutive elements of ``input``
    to each rank ``j`` (in rank order) and receives ``output_counts[r]`` into
    ``output``, rank-major. Over one rank it is a copy. Used by checkpoint
    conversions, not by the training step."""
    if group.world_size == 1:
        output.copy_(input)
        return
    dist.all_to_all_single(output, input, output_split_sizes=output_counts,
                           input_split_sizes=input_counts, group=group.process_group)
