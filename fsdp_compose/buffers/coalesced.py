"""One collective for several flat buffers (bucketing across units).

[Note: bucketing]
Small units pay more for the round-trip of a collective than for its bytes.
Consecutive small units (``runtime/buckets.py`` decides which) are gathered
by one all-gather and reduced by one reduce-scatter:

* all-gather: the shards ``s_1 .. s_k`` (``S_1 .. S_k`` elements, same dtype,
  same group) are packed into one input of ``T = sum S_i`` elements; the
  output is ``F * T`` elements, rank-major, so rank ``r``'s piece of buffer
  ``i`` is ``out[r*T + off_i : r*T + off_i + S_i]`` and one strided copy per
  buffer (``out.view(F, T)[:, off_i:off_i+S_i]`` into ``unsharded.view(F,
  S_i)``) puts every buffer's full values in place;
* reduce-scatter: each flat gradient ``g_i`` (``F * S_i``) is packed the same
  way (``packed.view(F, T)[:, off_i:off_i+S_i] = g_i.view(F, S_i)``), so the
  reduce-scatter's output (``T`` elements) is ``[chunk of g_1 .. chunk of
  g_k]`` for this rank, copied into each buffer's output.

Every element is reduced with the same partners in the same rank order as
without bucketing, and the copies are exact, so the numbers are the same bit
for bit (``tests/test_bucketing.py``); the price is the copies (small: only
small units are bucketed) and the packed temporaries (the bucket's bytes).
Each buffer keeps its own pending gather / reduction; they share one work,
which the first wait completes for all of them.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Sequence

import torch

from ..comm.collectives import all_gather_into, reduce_scatter_scaled
from .flat_buffer import FlatBuffer
from .flat_grad import ReduceOptions


class _CopyOutAfter:
    """A collective's work followed by copies out of its packed output: the
    first wait that returns does the copies (a wait that times out leaves
    them to a later one)."""

    def __init__(self, work: object, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._work: Optional[object] = work
        self._copies = copies  # (destination, source)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if self._work is None:
            return True
        if timeout is None:
            self._work.wait()
        else:
            self._work.wait(timeout)
        self._work = None
        with torch.no_grad():
            for destination, source in self._copies:
                destination.copy_(source)
        self._copies = []
        return True


def gather_coalesced(buffers: Sequence[FlatBuffer]) -> list[FlatBuffer]:
    """Issue one all-gather for every buffer of ``buffers`` that needs one
    (same shard group and compute dtype: the caller's promise); returns the
    buffers now gathering through it. A buffer that cannot join (kept
    post-forward piece) is left alone, for its own all-gather."""
    members: list[tuple[FlatBuffer, torch.Tensor, int]] = []
    for buffer in buffers:
        prepared = buffer.prepare_unshard(coalescable=True)
        if prepared is not None:
            members.append((buffer, prepared[0], buffer.unsharded._version))
    if not members:
        return []
    first = members[0][0]
    group, world = first.group, first.group.world_size
    total = sum(b.layout.shard_numel for b, _, _ in members)
    packed = torch.cat([shard.reshape(-1) for _, shard, _ in members]) if len(members) > 1 \
        else members[0][1]
    out = torch.empty(world * total, dtype=packed.dtype, device=first.compute_device)
    work = all_gather_into(out, packed, group, async_op=True)
    grid = out.view(world, total)
    copies, offset = [], 0
    for buffer, _, _ in members:
        size = buffer.layout.shard_numel
        copies.append((buffer.unsharded.detach().view(world, size),
                       grid[:, offset:offset + size]))
        offset += size
    shared = _CopyOutAfter(work, copies)
    for buffer, shard, version in members:
        buffer.adopt_gather(shared, shard, version)
    return [b for b, _, _ in members]


def reduce_coalesced(buffers: Sequence[FlatBuffer], options: ReduceOptions) -> list[FlatBuffer]:
    """Issue one reduce-scatter for the unreduced gradients of ``buffers``
    (same shard group and communication dtype: the caller's promise);
    returns the buffers now reducing through it (those with a gradient)."""
    members: list[tuple[FlatBuffer, torch.Tensor]] = []
    for buffer in buffers:
        flat = buffer.grad.take_for_reduce()
        if flat is not None:
            members.append((buffer, flat))
    if not members:
        return []
    first = members[0][0]
    group, world = first.group, first.group.world_size
    if world == 1:
        for buffer, flat in members:  # nothing to communicate: as start_reduce does
            work = reduce_scatter_scaled(flat, flat, group, options.divide_factor,
                                         options.force_sum, async_op=True)
            buffer.grad.adopt_reduce(work, flat, flat, options)
        return [b for b, _ in members]
    total = sum(b.layout.shard_numel for b, _ in members)
    packed = torch.empty(world * total, dtype=members[0][1].dtype, device=first.compute_device)
    grid = packed.view(world, total)
    offset = 0
    for buffer, flat in members:
        size = buffer.layout.shard_numel
        grid[:, offset:offset + size].copy_(flat.view(world, size))
        offset += size
    reduced = torch.empty(total, dtype=packed.dtype, device=first.compute_device)
    work = reduce_scatter_scaled(reduced, packed, group, options.divide_factor,
                                 options.force_sum, async_op=True)
    copies, outputs, offset = [], [], 0
    for buffer, _ in members:
        size = buffer.layout.shard_numel
        output = torch.empty(size, dtype=packed.dtype, device=first.compute_device)
        copies.append((output, reduced[offset:offset + size]))
        outputs.append(output)
        offset += size
    shared = _CopyOutAfter(work, copies)
    for (buffer, _), output in zip(members, outputs):
        buffer.grad.adopt_reduce(shared, packed, output, options)
    return [b for b, _ in members]
