"""Property tests of the flat layout math (no process group needed)."""

import torch
from hypothesis import given, settings, strategies as st

from fsdp_compose.buffers.layout import FlatLayout

shapes_st = st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), min_size=1, max_size=8)
world_st = st.integers(1, 16)


def _nonempty(shapes):
    return sum(FlatLayout(shapes, 1).numels) > 0


@settings(max_examples=200, deadline=None)
@given(shapes_st, world_st)
def test_every_element_owned_by_exactly_one_rank(shapes, world):
    layout = FlatLayout(shapes, world)
    owners = [0] * layout.numel
    for rank in range(world):
        for s in layout.shard_slices(rank):
            for k in range(s.length):
                owners[layout.offsets[s.param_index] + s.param_start + k] += 1
    assert owners == [1] * layout.numel


@settings(max_examples=200, deadline=None)
@given(shapes_st, world_st)
def test_padding_below_world_size_and_even_shards(shapes, world):
    layout = FlatLayout(shapes, world)
    assert layout.padded_numel % world == 0
    assert layout.shard_numel * world == layout.padded_numel
    if layout.numel > 0:
        assert 0 <= layout.padding < world
    ranges = [layout.shard_range(r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@settings(max_examples=200, deadline=None)
@given(shapes_st, world_st)
def test_slices_are_contiguous_and_inside_the_shard(shapes, world):
    layout = FlatLayout(shapes, world)
    for rank in range(world):
        lo, _ = layout.shard_range(rank)
        for s in layout.shard_slices(rank):
            assert 0 <= s.length
            assert 0 <= s.param_start <= layout.numels[s.param_index]
            assert s.param_start + s.length <= layout.numels[s.param_index]
            assert s.shard_start + s.length <= layout.shard_numel
            if s.length:
                assert lo + s.shard_start == layout.offsets[s.param_index] + s.param_start
                assert rank in layout.owner_ranks(s.param_index)


@settings(max_examples=150, deadline=None)
@given(shapes_st, world_st, st.integers(0, 2**31 - 1))
def test_shard_then_gather_round_trips_and_views_alias(shapes, world, seed):
    """Build each rank's shard from the parameters the way FlatBuffer does,
    concatenate the shards (what all-gather produces), and check that the
    per-parameter views of the result are the original values, and that the
    narrow() views of a shard alias its memory."""
    layout = FlatLayout(shapes, world)
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in layout.shapes]
    shards = []
    for rank in range(world):
        shard = torch.zeros(layout.shard_numel)
        for s in layout.shard_slices(rank):
            flat = params[s.param_index].reshape(-1)
            shard[s.shard_start:s.shard_start + s.length] = flat[s.param_start:s.param_start + s.length]
            view = shard.narrow(0, s.shard_start, s.length)
            if s.length:
                assert view.data_ptr() == shard.data_ptr() + s.shard_start * shard.element_size()
        shards.append(shard)
    gathered = torch.cat(shards)
    assert gathered.numel() == layout.padded_numel
    assert torch.all(gathered[layout.numel:] == 0)  # padding stays zero
    sizes = list(layout.numels) + ([layout.padding] if layout.padding else [])
    for original, chunk in zip(params, torch.split(gathered, sizes)):
        assert torch.equal(chunk.view(original.shape), original)


def test_known_layout_world_3():
    layout = FlatLayout([(7, 15), (15,), (97,)], 3)
    assert layout.numel == 105 + 15 + 97 == 217
    assert layout.padded_numel == 219 and layout.shard_numel == 73
    assert [s.length for s in layout.shard_slices(1)] == [32, 15, 26]
    assert list(layout.owner_ranks(0)) == [0, 1]
    assert list(layout.owner_ranks(2)) == [1, 2]


def test_rejects_bad_world_size_and_rank():
    import pytest
    with pytest.raises(ValueError):
        FlatLayout([(3,)], 0)
    with pytest.raises(ValueError):
        FlatLayout([(3,)], 2).shard_range(2)
