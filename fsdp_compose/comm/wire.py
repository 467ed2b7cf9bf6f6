"""How one flat buffer's collectives go on the wire, and how their waits are watched.

[Note: the wire interface]
A wire *issues*, never waits; it returns an :class:`Issued`. :class:`Wire` is
the exact wire, over this module's collectives (they never copy their
inputs); the quantized wire is ``quantized.py``'s, the custom one
``custom.py``'s. A buffer holds one; the queue issues through it.

[Note: flight log]
A backend fails naming no unit, so a wait that stalls past :func:`stall_seconds` or raises
tells its group's watcher, which compares the ranks' logs.
"""

from __future__ import annotations

import os
import weakref
from datetime import timedelta
from typing import NamedTuple, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from .groups import ShardGroup


class Waitable(Protocol):

    def wait(self) -> object: ...


class PartialSums(Protocol):

    def merge_partial(self, output: torch.Tensor) -> torch.Tensor: ...


class Issued(NamedTuple):
    """One collective on the wire: what to wait, copy after (``copies``), free after
    (``temporaries``), keep until the wait; a bucket's gathered ``grid`` ``(F, T)``."""

    work: Waitable
    process_group: Optional[dist.ProcessGroup]
    copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
    temporaries: Sequence[torch.Tensor] = ()
    keep_alive: Sequence[torch.Tensor] = ()
    grid: Optional[torch.Tensor] = None
    grid_is_ours: bool = False


class Wire:
    """The exact wire: the collectives below, on memory the queue may free."""

    __slots__ = ()

    def key(self) -> tuple:
        """Equal for wires a bucket may pack together."""
        return ("exact",)

    @property
    def quantizes(self) -> bool:
        return False

    @property
    def fills_members_at_completion(self) -> bool:
        """[Note: a bucket's copies]."""
        return True

    def on_policy(self, policy: "Wire") -> "Wire":
        return policy

    def subgroup_gather(self) -> "Wire":
        return self

    def gather_memory(self, numel: int, dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.Tensor, bool]:
        """And whether the queue may free it."""
        return torch.empty(numel, dtype=dtype, device=device), True

    def reduce_memory(self, numel: int, dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.Tensor, bool]:
        """A reduce-scatter buffer; whether the queue may free it."""
        return torch.empty(numel, dtype=dtype, device=device), True

    def reduce_group(self, group: ShardGroup) -> ShardGroup:
        return group

    def all_gather(self, destination: torch.Tensor, shard: torch.Tensor,
                   group: ShardGroup) -> Issued:
        work = all_gather_into(destination, shard, group, async_op=True)
        return Issued(work, group.process_group, keep_alive=(shard,))  # type: ignore[arg-type]

    def all_gather_packed(self, rows: Sequence[Optional[torch.Tensor]],
                          shards: Sequence[torch.Tensor], group: ShardGroup) -> Issued:
        """[Note: bucketing]; ``rows`` ``None``: not received."""
        world = group.world_size
        total = sum(shard.numel() for shard in shards)
        packed = torch.cat([s.reshape(-1) for s in shards]) if len(shards) > 1 else shards[0]
        out, ours = self.gather_memory(world * total, packed.dtype, group.device)
        work = self._all_gather_flat(out, packed, group)
        return Issued(work, group.process_group,
                      temporaries=[packed] if len(shards) > 1 else [],
                      keep_alive=shards, grid=out.view(world, total), grid_is_ours=ours)

    def _all_gather_flat(self, output: torch.Tensor, packed: torch.Tensor,
                         group: ShardGroup) -> Waitable:
        return all_gather_into(output, packed, group, async_op=True)  # type: ignore[return-value]

    def reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, group: ShardGroup,
                       divide_factor: Optional[float], force_sum: bool) -> Issued:
        """:func:`reduce_scatter_scaled`'s contract."""
        work = reduce_scatter_scaled(output, flat, group, divide_factor, force_sum, async_op=True)
        return Issued(work, group.process_group, keep_alive=(flat,))  # type: ignore[arg-type]

    def reduce_scatter_packed(self, grads: Sequence[Optional[torch.Tensor]],
                              chunks: Sequence[int], outputs: Sequence[Optional[torch.Tensor]],
                              group: ShardGroup, divide_factor: Optional[float],
                              force_sum: bool) -> Issued:
        """Each segment reduced as alone."""
        world, total = group.world_size, sum(chunks)
        dtype = next(g.dtype for g in grads if g is not None)
        packed, ours = self.reduce_memory(world * total, dtype, group.device)
        grid = packed.view(world, total)
        starts, offset = [], 0
        for flat, size in zip(grads, chunks):
            if flat is None:
                grid[:, offset:offset + size].zero_()
            else:
                grid[:, offset:offset + size].copy_(flat.view(world, size))
            starts.append(offset)
            offset += size
        reduced, _ = self.reduce_memory(total, dtype, group.device)
        work = self._reduce_scatter_flat(reduced, packed, group, divide_factor, force_sum,
                                         list(chunks))
        copies = [(output, reduced[start:start + size])
                  for output, start, size in zip(outputs, starts, chunks) if output is not None]
        return Issued(work, group.process_group, copies,
                      temporaries=[packed, reduced] if ours else [],
                      keep_alive=[packed, reduced])

    def _reduce_scatter_flat(self, output: torch.Tensor, flat: torch.Tensor, group: ShardGroup,
                             divide_factor: Optional[float], force_sum: bool,
                             segments: Optional[list[int]]) -> Waitable:
        return reduce_scatter_scaled(output, flat, group, divide_factor,  # type: ignore[return-value]
                                     force_sum, async_op=True)

    def replica_input(self, partials: PartialSums, output: torch.Tensor
                      ) -> Optional[torch.Tensor]:
        """``None``: keep a partial sum."""
        return output

    def before_fold(self, output: torch.Tensor) -> None:
        """Before the result is folded."""


EXACT = Wire()


# ----------------------------------------------------------------- collectives
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


# ------------------------------------------------------------------- waits
STALL_ENV = "FSDP_COMPOSE_STALL_SECONDS"
"""Seconds a collective may wait before its watcher is told (default 10)."""
DEFAULT_STALL_SECONDS = 10.0


class Watcher(Protocol):

    def stalled(self, process_group: dist.ProcessGroup, error: Optional[BaseException],
                waited: float) -> None:
        """Stalled ``waited`` seconds, or raised ``error``."""

    def recovered(self, process_group: dist.ProcessGroup) -> None:
        """The stalled wait finished."""


_watchers: "dict[str, weakref.ref[Watcher]]" = {}


def watch(process_group: dist.ProcessGroup, watcher: Watcher) -> None:
    """Gloo only (a timed wait elsewhere blocks)."""
    if dist.get_backend(process_group) == "gloo":
        _watchers[process_group.group_name] = weakref.ref(watcher)


def stall_seconds() -> float:
    value = os.environ.get(STALL_ENV, "")
    return float(value) if value else DEFAULT_STALL_SECONDS


def wait_watched(work, process_group: Optional[dist.ProcessGroup]) -> None:
    """``work.wait()`` ([Note: flight log])."""
    ref = _watchers.get(process_group.group_name) if process_group is not None else None
    watcher = ref() if ref is not None else None
    if watcher is None:
        work.wait()
        return
    stall = stall_seconds()
    waited, told = 0.0, False
    while True:
        try:
            work.wait(timedelta(seconds=stall))
            break
        except RuntimeError as error:
            if not _is_timeout(error):
                watcher.stalled(process_group, error, waited)
                raise
            waited += stall
            told = True
            watcher.stalled(process_group, None, waited)
    if told:
        watcher.recovered(process_group)


def _is_timeout(error: RuntimeError) -> bool:
    return "Operation timed out!" in str(error) and "Timed out waiting" not in str(error)
