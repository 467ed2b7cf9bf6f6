"""Property tests of the flat <-> dim-0 chunks exchange plan
(``fsdp_compose/checkpoint/_chunks.py``), no process group needed.

The all-to-all is simulated with plain tensors: every rank's shard is cut
from one full flat vector per :class:`FlatLayout`, each rank sends its
``send_intervals`` split by ``send_counts``, and each rank concatenates what
it receives from ranks ``0..F-1`` in order. The packed result must be torch
FSDP2's layout (``torch.chunk(param, F, dim=0)[rank]``, empty on trailing
ranks; a 0-dim parameter whole on every rank), and the reverse exchange must
rebuild every rank's shard at the selected parameters' positions only.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings, strategies as st

from fsdp_compose.buffers.layout import FlatLayout
from fsdp_compose.checkpoint._chunks import chunk_shape, dim0_rows, exchange_plan

# 0-dim shapes, 0-size dims, dim 0 below the world size, 1-D .. 3-D
shapes_st = st.lists(st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple),
                     min_size=1, max_size=6)
world_st = st.integers(1, 5)


@st.composite
def cases(draw):
    shapes = draw(shapes_st)
    world = draw(world_st)
    selected = draw(st.lists(st.sampled_from(range(len(shapes))), unique=True))
    return shapes, world, selected


def _expected_chunk(param: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """torch FSDP2's Shard(0) local tensor of ``param`` on ``rank``."""
    if param.dim() == 0:
        return param
    pieces = torch.chunk(param, world, dim=0)
    if rank < len(pieces):
        return pieces[rank]
    return param.new_empty((0, *param.shape[1:]))


def _setup(shapes, world):
    layout = FlatLayout(shapes, world)
    # distinct values (padding included): any misplaced element is detected
    full = torch.arange(layout.padded_numel, dtype=torch.float64) + 1.0
    params = [full[o:o + n].view(s) for o, n, s in zip(layout.offsets, layout.numels, layout.shapes)]
    shards = [full[slice(*layout.shard_range(r))].clone() for r in range(world)]
    return layout, params, shards


def _split(t: torch.Tensor, counts) -> list[torch.Tensor]:
    assert t.numel() == sum(counts)
    return list(torch.split(t, list(counts)))


def _all_to_all(sends: list[torch.Tensor], counts: list) -> list[torch.Tensor]:
    """Simulated ``all_to_all_single``: rank ``r`` sends ``counts[r][j]``
    consecutive elements of ``sends[r]`` to rank ``j``; each rank receives
    its pieces concatenated in source-rank order."""
    outgoing = [_split(send, c) for send, c in zip(sends, counts)]
    return [torch.cat([outgoing[src][dst] for src in range(len(sends))])
            for dst in range(len(sends))]


def _packed(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.float64)


@settings(max_examples=200, deadline=None)
@given(cases())
def test_plan_counts_are_consistent(case):
    shapes, world, selected = case
    layout = FlatLayout(shapes, world)
    plans = [exchange_plan(layout, r, selected) for r in range(world)]
    for r, plan in enumerate(plans):
        assert len(plan.send_counts) == world and len(plan.recv_counts) == world
        # what r sends j is what j expects from r
        for j in range(world):
            assert plan.send_counts[j] == plans[j].recv_counts[r], (r, j)
        assert sum(length for _, length in plan.send_intervals) == sum(plan.send_counts)
        for start, length in plan.send_intervals:
            assert length > 0 and 0 <= start and start + length <= layout.shard_numel
        # the chunks: one per selected parameter, layout order, packed back to back
        assert [c.param_index for c in plan.chunks] == sorted(selected)
        packed = 0
        for c in plan.chunks:
            shape = layout.shapes[c.param_index]
            assert c.packed_start == packed
            assert c.shape == chunk_shape(shape, world, r) == tuple(
                _expected_chunk(torch.empty(shape), world, r).shape)
            assert c.numel == math.prod(c.shape)
            assert c.row_start == dim0_rows(shape, world, r)[0]
            packed += c.numel
        assert plan.packed_numel == packed


@settings(max_examples=200, deadline=None)
@given(cases())
def test_flat_to_chunks_gives_torch_chunk(case):
    shapes, world, selected = case
    layout, params, shards = _setup(shapes, world)
    plans = [exchange_plan(layout, r, selected) for r in range(world)]
    sends = [_packed([shards[r][s:s + n] for s, n in plan.send_intervals])
             for r, plan in enumerate(plans)]
    received = _all_to_all(sends, [plan.send_counts for plan in plans])
    for j, (plan, packed) in enumerate(zip(plans, received)):
        assert packed.numel() == plan.packed_numel == sum(plan.recv_counts)
        for c in plan.chunks:
            got = packed[c.packed_start:c.packed_start + c.numel].view(c.shape)
            want = _expected_chunk(params[c.param_index], world, j)
            assert got.shape == want.shape, (j, c, want.shape)
            assert torch.equal(got, want), (j, c)


@settings(max_examples=200, deadline=None)
@given(cases())
def test_chunks_to_flat_rebuilds_selected_positions(case):
    shapes, world, selected = case
    layout, params, shards = _setup(shapes, world)
    plans = [exchange_plan(layout, r, selected) for r in range(world)]
    # rank j packs its (correct) chunks and sends rank r the recv_counts[r] slice
    sends = [_packed([_expected_chunk(params[c.param_index], world, j).reshape(-1)
                      for c in plan.chunks]) for j, plan in enumerate(plans)]
    assert [t.numel() for t in sends] == [plan.packed_numel for plan in plans]
    for r, (plan, received) in enumerate(zip(plans, _all_to_all(
            sends, [plan.recv_counts for plan in plans]))):
        assert received.numel() == sum(plan.send_counts)
        out = torch.full((layout.shard_numel,), -1.0, dtype=torch.float64)
        offset = 0
        for start, length in plan.send_intervals:
            out[start:start + length] = received[offset:offset + length]
            offset += length
        want = torch.full_like(out, -1.0)
        for s in layout.shard_slices(r):
            if s.param_index in selected and s.length:
                want[s.shard_start:s.shard_start + s.length] = \
                    shards[r][s.shard_start:s.shard_start + s.length]
        assert torch.equal(out, want), (r, out, want)


def test_examples_by_hand():
    # dim 0 below the world size: trailing ranks empty; 0-dim: whole everywhere
    assert [dim0_rows((2, 3), 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert [dim0_rows((5,), 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [dim0_rows((), 3, r) for r in range(3)] == [(0, 1)] * 3
    assert chunk_shape((0, 4), 2, 1) == (0, 4)
    assert chunk_shape((), 2, 1) == ()
    layout = FlatLayout([(97, 7), (7,)], 2)  # 686 elements, 343 per rank
    plan0 = exchange_plan(layout, 0, [0, 1])
    # rank 0 owns flat [0, 343): rows 0..48 of the first param (343 = 49 * 7); its chunk
    # is rows 0..48 (ceil(97/2) = 49): everything stays, nothing goes to rank 1
    assert plan0.send_counts == (343, 0)
    assert plan0.recv_counts == (343, 4)  # plus bias[0:4] from rank 1
    plan1 = exchange_plan(layout, 1, [0, 1])
    assert plan1.send_counts == (4, 336 + 3)
    assert plan1.recv_counts == (0, 339)
