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

Fixed sizes: a bucket's collectives always carry *every* buffer of the
bucket (``T`` is the bucket's, whatever this rank needs): a member already
gathered contributes its shard and receives nothing, a member without a
gradient contributes zeros. The bucket plan is the same on every rank (it
changes only where the ranks have just agreed, ``runtime/buckets.py``), so
ranks whose control flow differs inside a bucket (a unit skipped on one
rank) still issue collectives of equal size: they pair instead of making
gloo abort the process, and the fingerprint at the end of backward names
the difference on every rank ([Note: rank divergence]). In a run without
divergence every rank needs the same members, so nothing is padded.
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
    them to a later one), then frees the memory of ``temporaries`` (the
    packed tensors this module allocated for the collective).

    [Note: freeing the packed temporaries]
    Dropping the last Python reference to a packed tensor does not free it
    when the backend still holds one: gloo keeps a finished collective's
    input and output tensors alive for a while, sometimes through the whole
    next step (on the many-small benchmark, the first bucket's packed input
    and output, 6 MiB on one rank after the step; issue 22). Once the work
    is complete and the copies are made nothing reads them, so their storage
    is resized to 0 bytes, which frees the memory whoever holds the tensor
    (and which memory trackers see)."""

    def __init__(self, work: object, copies: list[tuple[torch.Tensor, torch.Tensor]],
                 temporaries: Sequence[torch.Tensor] = ()) -> None:
        self._work: Optional[object] = work
        self._copies = copies  # (destination, source)
        self._temporaries = list(temporaries)

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
        for tensor in self._temporaries:  # see [Note: freeing the packed temporaries]
            tensor.untyped_storage().resize_(0)
        self._temporaries = []
        return True


def gather_coalesced(buffers: Sequence[FlatBuffer], wanted: Sequence[FlatBuffer]) -> list[FlatBuffer]:
    """Issue one all-gather of the shards of every buffer of ``buffers`` (a
    bucket's, same shard group and compute dtype: the caller's promise) and
    fill those of ``wanted`` that need it; returns the buffers now gathering
    through it. The collective's size depends on ``buffers`` only (see
    [Note: bucketing]): a buffer not wanted, or that cannot join (already
    gathered or in flight, a kept post-forward piece), contributes its shard
    and receives nothing. Nothing is issued when no wanted buffer needs it."""
    wanted_ids = {id(b) for b in wanted}
    inputs: list[torch.Tensor] = []
    members: list[tuple[FlatBuffer, torch.Tensor, int, int]] = []  # buffer, shard, version, offset
    offset = 0
    for buffer in buffers:
        prepared = buffer.prepare_unshard(coalescable=True) if id(buffer) in wanted_ids else None
        if prepared is not None:
            members.append((buffer, prepared[0], buffer.unsharded._version, offset))
            inputs.append(prepared[0])
        else:
            inputs.append(buffer.gather_input())
        offset += buffer.layout.shard_numel
    if not members:
        return []
    first = buffers[0]
    group, world, total = first.group, first.group.world_size, offset
    packed = torch.cat([shard.reshape(-1) for shard in inputs]) if len(inputs) > 1 else inputs[0]
    out = torch.empty(world * total, dtype=packed.dtype, device=first.compute_device)
    temporaries = [out, packed] if len(inputs) > 1 else [out]  # one input: a shard, not ours
    work = all_gather_into(out, packed, group, async_op=True)
    grid = out.view(world, total)
    copies = []
    for buffer, _, _, start in members:
        size = buffer.layout.shard_numel
        copies.append((buffer.unsharded.detach().view(world, size), grid[:, start:start + size]))
    shared = _CopyOutAfter(work, copies, temporaries)
    for buffer, shard, version, _ in members:
        buffer.adopt_gather(shared, shard, version)
    return [b for b, _, _, _ in members]


def reduce_coalesced(buffers: Sequence[FlatBuffer], options: ReduceOptions) -> list[FlatBuffer]:
    """Issue one reduce-scatter for the gradients of ``buffers`` (a bucket's
    trainable buffers, same shard group and communication dtype: the
    caller's promise); returns the buffers now reducing through it (those
    with an unreduced gradient). The collective's size depends on
    ``buffers`` only (see [Note: bucketing]): a buffer without a gradient
    contributes zeros and receives nothing."""
    grads: list[Optional[torch.Tensor]] = [b.grad.take_for_reduce() for b in buffers]
    members = [(b, g) for b, g in zip(buffers, grads) if g is not None]
    if not members:
        return []
    first = buffers[0]
    group, world = first.group, first.group.world_size
    if world == 1:
        for buffer, flat in members:  # nothing to communicate: as start_reduce does
            work = reduce_scatter_scaled(flat, flat, group, options.divide_factor,
                                         options.force_sum, async_op=True)
            buffer.grad.adopt_reduce(work, flat, flat, options)
        return [b for b, _ in members]
    total = sum(b.layout.shard_numel for b in buffers)
    dtype = members[0][1].dtype
    packed = torch.empty(world * total, dtype=dtype, device=first.compute_device)
    grid = packed.view(world, total)
    starts, offset = [], 0
    for buffer, flat in zip(buffers, grads):
        size = buffer.layout.shard_numel
        if flat is None:
            grid[:, offset:offset + size].zero_()
        else:
            grid[:, offset:offset + size].copy_(flat.view(world, size))
        starts.append(offset)
        offset += size
    reduced = torch.empty(total, dtype=dtype, device=first.compute_device)
    work = reduce_scatter_scaled(reduced, packed, group, options.divide_factor,
                                 options.force_sum, async_op=True)
    copies, outputs = [], []
    for buffer, flat, start in zip(buffers, grads, starts):
        if flat is None:
            continue
        size = buffer.layout.shard_numel
        output = torch.empty(size, dtype=dtype, device=first.compute_device)
        copies.append((output, reduced[start:start + size]))
        outputs.append(output)
    shared = _CopyOutAfter(work, copies, [packed, reduced])
    for (buffer, _), output in zip(members, outputs):
        buffer.grad.adopt_reduce(shared, packed, output, options)
    return [b for b, _ in members]
