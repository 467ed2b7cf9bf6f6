"""The per-parameter views of a flat buffer as one autograd node
(``buffers/param_views.py``): the same views and the same flat gradient as
a differentiable split + view per parameter, for every placement, padding
and unused parameters; one backward node per buffer; and a sharded unit's
graph holds no per-parameter view node."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_compose.buffers.layout import FLAT, ROWS, FlatLayout, ShardDim
from fsdp_compose.buffers.param_views import SplitIntoParams, ViewPlan, split_plan, strided_view

from ..harness import run_distributed


def _reference_views(flat: torch.Tensor, layout: FlatLayout, moved: list[int]) -> list[torch.Tensor]:
    """What the buffer built before: a differentiable split into segments,
    pieces concatenated where a parameter is not contiguous, then a view."""
    chunks = torch.split(flat, [s.length for s in layout.segments()])
    pieces: list[list[torch.Tensor]] = [[] for _ in layout.shapes]
    for chunk, segment in zip(chunks, layout.segments()):
        if segment.param_index >= 0:
            pieces[segment.param_index].append(chunk)
    out = []
    for index, parts in enumerate(pieces):
        whole = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else flat[:0]
        view = whole.view(layout.stored_shapes[index])
        out.append(view.movedim(0, moved[index]) if moved[index] else view)
    return out


_shapes = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(shapes=_shapes, world=st.integers(1, 4), kind=st.sampled_from(["flat", "rows", "dim"]),
       used=st.lists(st.booleans(), min_size=5, max_size=5), seed=st.integers(0, 2**16))
def test_views_and_flat_gradient_match_split_and_view(shapes, world, kind, used, seed):
    if kind == "dim":
        placements = [ShardDim(len(s) - 1) for s in shapes]
        moved = [len(s) - 1 for s in shapes]
    else:
        placements = [FLAT if kind == "flat" else ROWS] * len(shapes)
        moved = [0] * len(shapes)
    layout = FlatLayout(shapes, world, placements)
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(layout.padded_numel, generator=generator, dtype=torch.float64)

    ours_flat = values.clone().requires_grad_(True)
    seen: list[list[bool]] = []
    views = SplitIntoParams.apply(ours_flat, ViewPlan(layout, moved), (True,) * len(shapes),
                                  lambda grads: seen.append([g is not None for g in grads]))
    ref_flat = values.clone().requires_grad_(True)
    ref_views = _reference_views(ref_flat, layout, moved)

    loss_terms, ref_terms = [], []
    for index, (view, ref) in enumerate(zip(views, ref_views)):
        assert view.shape == ref.shape and torch.equal(view.detach(), ref.detach())
        if view.numel() and layout.is_contiguous(index):  # a view of the buffer, no copy
            assert view.data_ptr() - ours_flat.data_ptr() == ref.data_ptr() - ref_flat.data_ptr()
            assert view.stride() == ref.stride()
        if used[index]:
            weight = torch.randn(view.shape, generator=generator, dtype=torch.float64)
            loss_terms.append((view * weight).sum())
            ref_terms.append((ref * weight).sum())
    if not loss_terms:
        return
    sum(loss_terms).backward()
    sum(ref_terms).backward()
    assert torch.equal(ours_flat.grad, ref_flat.grad)
    assert seen == [[used[i] for i in range(len(shapes))]]


@settings(max_examples=60, deadline=None)
@given(shapes=_shapes, world=st.integers(1, 4), kind=st.sampled_from(["flat", "rows", "dim"]))
def test_local_views_by_one_split_match_each_view(shapes, world, kind):
    """``split_plan`` (how a buffer cuts a shard-shaped tensor into every
    parameter's local piece in one ``split``) gives the same views as one
    ``as_strided`` per parameter, on every rank, or declines (``None``)
    where some piece is not a 1-D run; it applies to every ``"flat"`` layout."""
    placements = {"flat": FLAT, "rows": ROWS}
    layout = FlatLayout(shapes, world, [placements.get(kind) or ShardDim(len(s) - 1)
                                        for s in shapes])
    for rank in range(world):
        slices = layout.shard_slices(rank)
        strided = [strided_view(layout.local_shape(i, rank),
                                len(s) - 1 if kind == "dim" else 0, slices[i].shard_start)
                   for i, s in enumerate(shapes)]
        shard = torch.randn(layout.shard_numel)
        expected = [shard.as_strided(size, stride, offset) for size, stride, offset in strided]
        plan = split_plan(strided, layout.shard_numel)
        if kind == "flat":
            assert plan is not None
        if plan is None:
            continue
        sizes, picks = plan
        parts = shard.split_with_sizes(sizes)
        for index, mine in enumerate(parts[i] for i in picks):
            ref = expected[index]
            assert mine.shape == ref.shape
            if ref.numel():
                assert mine.data_ptr() == ref.data_ptr() and mine.stride() == ref.stride()


def test_frozen_outputs_take_no_gradient():
    layout = FlatLayout([(3, 2), (4,)], 2)
    flat = torch.randn(layout.padded_numel).requires_grad_(True)
    weight, bias = SplitIntoParams.apply(flat, ViewPlan(layout, [0, 0]), (True, False),
                                         lambda grads: None)
    assert weight.requires_grad and not bias.requires_grad
    (weight.sum() + bias.sum()).backward()
    expected = torch.zeros(layout.padded_numel)
    expected[:6] = 1
    assert torch.equal(flat.grad, expected)


def test_one_backward_node_per_buffer_and_no_view_nodes():
    """A sharded unit's parameters reach the flat buffer through one node:
    walking the loss's graph finds one ``SplitIntoParams`` node per
    trainable buffer and no ``ViewBackward``/``SplitWithSizesBackward``
    between a parameter's use and the buffer's ``AccumulateGrad``."""
    run_distributed(2, _graph_nodes)


def _graph_nodes() -> None:
    from fsdp_compose import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.LayerNorm(3))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    loss = model(torch.randn(4, 5)).sum()
    names: list[str] = []
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    assert names.count("SplitIntoParamsBackward") == 3, names  # one per unit (one buffer each)
    assert not any(n.startswith(("ViewBackward", "SplitWithSizesBackward")) for n in names), names
    loss.backward()
    expected = sum(math.prod(p.shape) for p in model.parameters())
    assert expected > 0


def test_aliases_serve_every_forward_with_the_views_values_and_gradient():
    """[Note: parameter aliases made once]: the node hands out the same
    tensors at every forward, each reading what the storage holds now (also
    after its memory was freed and given back) at the offset and strides of
    the view it replaces, and the flat gradient is the views' one."""
    layout = FlatLayout([(3, 2), (4,), (2, 5)], 3, [ROWS] * 3)
    plan = ViewPlan(layout, [0, 0, 0])
    generator = torch.Generator().manual_seed(0)
    flat = torch.zeros(layout.padded_numel, dtype=torch.float64).requires_grad_(True)
    aliases = plan.aliases(flat)
    assert aliases is not None and not any(a._is_view() for a in aliases)
    nbytes = flat.untyped_storage().nbytes()
    for forward in range(3):
        flat.untyped_storage().resize_(0)  # a reshard, then an unshard filling new values
        flat.untyped_storage().resize_(nbytes)
        values = torch.randn(layout.padded_numel, generator=generator, dtype=torch.float64)
        with torch.no_grad():
            flat.copy_(values)
        ref = values.clone().requires_grad_(True)
        outputs = SplitIntoParams.apply(flat, plan, (True,) * 3, lambda grads: None, aliases)
        assert all(out is alias for out, alias in zip(outputs, aliases))
        ref_views = _reference_views(ref, layout, [0, 0, 0])
        weights = [torch.randn(v.shape, generator=generator, dtype=torch.float64) for v in ref_views]
        for out, view in zip(outputs, ref_views):
            assert torch.equal(out.detach(), view.detach()) and out.stride() == view.stride()
            assert out.data_ptr() - flat.data_ptr() == view.data_ptr() - ref.data_ptr()
        flat.grad = None
        sum((o * w).sum() for o, w in zip(outputs, weights)).backward()
        sum((v * w).sum() for v, w in zip(ref_views, weights)).backward()
        assert torch.equal(flat.grad, ref.grad), forward


def test_a_unit_hands_forward_the_same_tensors_until_a_parameter_is_frozen():
    run_distributed(2, _forward_tensors)


def _forward_tensors() -> None:
    from fsdp_compose import fully_shard
    from tests._owners import buffer_of
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    fully_shard(model[0])
    fully_shard(model)
    buffer = buffer_of(model[0].weight)
    seen = []

    def capture(module, args):  # runs after fully_shard's pre-forward hook
        storage = buffer.unsharded.untyped_storage()
        assert module.weight.untyped_storage().data_ptr() == storage.data_ptr() != 0
        seen.append((module.weight, module.bias))

    model[0].register_forward_pre_hook(capture)
    for step in range(4):
        if step == 2:
            model[0].bias.requires_grad_(False)  # a mixed buffer: views made per forward
        model(torch.randn(4, 5)).sum().backward()
    assert seen[0][0] is seen[1][0] and seen[0][1] is seen[1][1]
    assert seen[2][0] is not seen[3][0] and not seen[2][1].requires_grad
