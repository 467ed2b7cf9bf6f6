"""Block-wise quantization of what the collectives move (``CommPolicy``).

[Note: block-quantized wire format]
A flat tensor is cut into blocks of ``B`` elements (the last zero-padded),
each with one fp32 scale ``absmax / qmax`` and codes ``x / scale`` (int8 or
fp8 e4m3); the payload's size is equal on every rank. Decoding errs by at
most half a code step; a non-finite block decodes to non-finite values, so
overflow still reaches a grad scaler. Every rank decodes the same payload,
own chunk included, so all compute with identical parameters; the sharded
master copy is never quantized.

[Note: quantized reduce-scatter]
Codes with different scales cannot be summed in a reduce-scatter, so the
quantized reduction is an all-to-all (ZeRO++'s qgZ), each rank summing the
decoded chunks in fp32, in rank order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .wire import EXACT, Issued, Waitable, Wire, all_gather_flat, needs_post_division
from .groups import ShardGroup

FP8_E4M3 = getattr(torch, "float8_e4m3fn", None)

_QMAX = {torch.int8: 127.0}
if FP8_E4M3 is not None:
    _QMAX[FP8_E4M3] = 448.0


def code_dtypes() -> tuple[torch.dtype, ...]:
    return tuple(_QMAX)


@dataclass(frozen=True)
class BlockQuantizer:
    """One collective's wire format ([Note: block-quantized wire format]); ``block`` is a
    positive multiple of 4."""

    code_dtype: torch.dtype
    block: int

    def __post_init__(self) -> None:
        if self.code_dtype not in _QMAX:
            names = ", ".join(str(d) for d in _QMAX)
            raise ValueError(f"quantized collectives support the code dtypes {names}, "
                             f"got {self.code_dtype!r}")
        if self.block <= 0 or self.block % 4:
            raise ValueError(f"the quantization block must be a positive multiple of 4 "
                             f"elements, got {self.block}")

    @property
    def qmax(self) -> float:
        return _QMAX[self.code_dtype]

    def blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block)

    def payload_bytes(self, numel: int) -> int:
        blocks = self.blocks(numel)
        return blocks * self.block + 4 * blocks

    def error_bound(self, block_absmax: torch.Tensor) -> torch.Tensor:
        if self.code_dtype == torch.int8:
            return block_absmax / (2 * self.qmax)
        return block_absmax / 16

    def encode(self, values: torch.Tensor, payload: torch.Tensor) -> None:
        numel, block = values.numel(), self.block
        blocks = self.blocks(numel)
        grid = values.reshape(-1).float()
        if blocks * block != numel:
            grid = torch.nn.functional.pad(grid, (0, blocks * block - numel))
        grid = grid.view(blocks, block)
        scales = payload[blocks * block:].view(torch.float32)
        torch.div(grid.abs().amax(dim=1), self.qmax, out=scales)
        inverse = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales))
        scaled = grid * inverse.unsqueeze(1)
        codes = payload[:blocks * block].view(self.code_dtype).view(blocks, block)
        # int8 rounding stays within +-127; fp8's cast gives nan past 448, so clamp. A non-finite
        # block's codes do not matter.
        if self.code_dtype == torch.int8:
            codes.copy_(scaled.round_())
        else:
            codes.copy_(scaled.clamp_(-self.qmax, self.qmax))

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        numel, block = out.numel(), self.block
        blocks = self.blocks(numel)
        codes = payload[:blocks * block].view(self.code_dtype).view(blocks, block)
        scales = payload[blocks * block:blocks * block + 4 * blocks].view(torch.float32)
        if self.code_dtype == torch.int8 and out.dtype == torch.float32 and \
                blocks * block == numel and out.is_contiguous():
            torch.mul(codes, scales.unsqueeze(1), out=out.view(blocks, block))
            return
        values = codes.float().mul_(scales.unsqueeze(1)).view(-1)
        out.copy_(values[:numel] if blocks * block != numel else values)


class QuantizedWork:
    """A quantized collective's work: ``wait`` waits, decodes once and frees the wire buffers."""

    def __init__(self, work: Optional[dist.Work], finish: Callable[[], None],
                 wire: Sequence[torch.Tensor]) -> None:
        self._work = work
        self._finish: Optional[Callable[[], None]] = finish
        self._wire = list(wire)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if self._finish is None:
            return True
        if self._work is not None:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)  # raises if it runs out: decoded at a later wait
            self._work = None
        finish, self._finish = self._finish, None
        finish()
        for tensor in self._wire:
            tensor.untyped_storage().resize_(0)
        self._wire = []
        return True


def all_gather_quantized(destinations: Sequence[Optional[torch.Tensor]],
                         shards: Sequence[torch.Tensor], group: ShardGroup,
                         quantizer: BlockQuantizer) -> QuantizedWork:
    """One packed asynchronous all-gather of the quantized ``shards`` into ``destinations``
    (``None``: not needed here), decoded at the wait."""
    sizes = [quantizer.payload_bytes(s.numel()) for s in shards]
    total, world = sum(sizes), group.world_size
    device = destinations[0].device
    packed = torch.empty(total, dtype=torch.uint8, device=device)
    offsets = []
    offset = 0
    for shard, size in zip(shards, sizes):
        quantizer.encode(shard, packed[offset:offset + size])
        offsets.append(offset)
        offset += size
    gathered = torch.empty(world * total, dtype=torch.uint8, device=device)
    work = all_gather_flat(gathered, packed, group=group.process_group, async_op=True)

    def finish() -> None:
        rows = gathered.view(world, total)
        with torch.no_grad():
            for destination, start, size in zip(destinations, offsets, sizes):
                if destination is None:
                    continue
                for rank in range(world):
                    quantizer.decode(rows[rank, start:start + size], destination[rank])

    return QuantizedWork(work, finish, [gathered, packed])


def reduce_scatter_quantized(output: torch.Tensor, flat: torch.Tensor, group: ShardGroup,
                             quantizer: BlockQuantizer, divide_factor: Optional[float] = None,
                             force_sum: bool = False,
                             segments: Optional[Sequence[int]] = None) -> QuantizedWork:
    """``collectives.reduce_scatter_scaled``'s contract as an all-to-all of
    quantized chunks; ``flat`` is encoded now. ``segments``: sizes of the
    buffers in a chunk, each with its own blocks (so bucketing changes no
    result)."""
    world, chunk = group.world_size, output.numel()
    segments = list(segments) if segments is not None else [chunk]
    sizes = [quantizer.payload_bytes(n) for n in segments]
    size = sum(sizes)
    device = flat.device
    sent = torch.empty(world * size, dtype=torch.uint8, device=device)
    chunks = flat.view(world, chunk)
    for rank in range(world):
        for (start, stop), (wire_start, wire_stop) in _spans(segments, sizes, rank * size):
            quantizer.encode(chunks[rank, start:stop], sent[wire_start:wire_stop])
    received = torch.empty_like(sent)
    work = dist.all_to_all_single(received, sent, group=group.process_group, async_op=True)
    average = not needs_post_division(group, divide_factor, force_sum)

    def finish() -> None:
        total = torch.zeros(chunk, dtype=torch.float32, device=device)
        part = torch.empty(chunk, dtype=torch.float32, device=device)
        for rank in range(world):
            for (start, stop), (wire_start, wire_stop) in _spans(segments, sizes, rank * size):
                quantizer.decode(received[wire_start:wire_stop], part[start:stop])
            total.add_(part)
        if average:
            total.div_(world)
        output.copy_(total)

    return QuantizedWork(work, finish, [sent, received])


def _spans(segments: Sequence[int], sizes: Sequence[int], wire_offset: int):
    start, wire = 0, wire_offset
    for numel, size in zip(segments, sizes):
        yield (start, start + numel), (wire, wire + size)
        start += numel
        wire += size


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
