"""How one flat buffer's collectives go on the wire.

[Note: the wire interface]
A wire *issues*, never waits; it returns an :class:`Issued`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from .collectives import all_gather_into, reduce_scatter_scaled
from .custom import UnitComms, all_gather_custom, allocate, reduce_scatter_custom
from .groups import ShardGroup
from .quantized import BlockQuantizer, all_gather_quantized, reduce_scatter_quantized


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
    """``collectives.py``'s collectives on memory the queue may free."""

    __slots__ = ()

    comms: Optional[UnitComms] = None

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
        """``collectives.reduce_scatter_scaled``'s contract."""
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


class QuantizedWire(Wire):
    """[Note: block-quantized wire format], where a direction has a quantizer."""

    __slots__ = ("gather_quantizer", "reduce_quantizer")

    def __init__(self, gather_quantizer: Optional[BlockQuantizer],
                 reduce_quantizer: Optional[BlockQuantizer]) -> None:
        self.gather_quantizer = gather_quantizer
        self.reduce_quantizer = reduce_quantizer

    def key(self) -> tuple:
        return ("quantized", self.gather_quantizer, self.reduce_quantizer)

    @property
    def quantizes(self) -> bool:
        return True

    @property
    def fills_members_at_completion(self) -> bool:
        return self.gather_quantizer is None  # decoded at the wait

    def subgroup_gather(self) -> Wire:
        return EXACT

    def all_gather(self, destination: torch.Tensor, shard: torch.Tensor,
                   group: ShardGroup) -> Issued:
        if self.gather_quantizer is None:
            return super().all_gather(destination, shard, group)
        rows = destination.view(group.world_size, -1)
        work = all_gather_quantized([rows], [shard], group, self.gather_quantizer)
        return Issued(work, group.process_group, keep_alive=(shard,))

    def all_gather_packed(self, rows: Sequence[Optional[torch.Tensor]],
                          shards: Sequence[torch.Tensor], group: ShardGroup) -> Issued:
        if self.gather_quantizer is None:
            return super().all_gather_packed(rows, shards, group)
        work = all_gather_quantized(rows, shards, group, self.gather_quantizer)
        return Issued(work, group.process_group, keep_alive=shards)

    def reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, group: ShardGroup,
                       divide_factor: Optional[float], force_sum: bool) -> Issued:
        if self.reduce_quantizer is None:
            return super().reduce_scatter(output, flat, group, divide_factor, force_sum)
        work = reduce_scatter_quantized(output, flat, group, self.reduce_quantizer,
                                        divide_factor, force_sum)
        return Issued(work, group.process_group, keep_alive=(flat,))

    def _reduce_scatter_flat(self, output: torch.Tensor, flat: torch.Tensor, group: ShardGroup,
                             divide_factor: Optional[float], force_sum: bool,
                             segments: Optional[list[int]]) -> Waitable:
        if self.reduce_quantizer is None:
            return super()._reduce_scatter_flat(output, flat, group, divide_factor, force_sum,
                                                segments)
        return reduce_scatter_quantized(output, flat, group, self.reduce_quantizer,
                                        divide_factor, force_sum, segments)


def policy_wire(gather_quantizer: Optional[BlockQuantizer],
                reduce_quantizer: Optional[BlockQuantizer]) -> Wire:
    if gather_quantizer is None and reduce_quantizer is None:
        return EXACT
    return QuantizedWire(gather_quantizer, reduce_quantizer)


class CustomWire(Wire):
    """[Note: custom collectives]; the queue never frees their memory."""

    __slots__ = ("comms", "base")

    def __init__(self, comms: UnitComms, base: Wire) -> None:
        self.comms: UnitComms = comms  # type: ignore[misc]
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
