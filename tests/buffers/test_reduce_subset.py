"""Parameters frozen after ``fully_shard`` are not reduced:
the packed reduction of ``buffers/reduce_subset.py`` equals the whole
reduce-scatter on every position that trains (any layout, flags and world
size), and a unit whose weights are frozen after annotation moves only its
trainable elements while training exactly as one process does."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_compose.buffers.layout import FLAT, ROWS, FlatLayout
from fsdp_compose.buffers.reduce_subset import plan_subset

from .._comm_counter import REDUCE_SCATTER, CollectiveCounter
from ..harness import run_distributed


@settings(max_examples=80, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=2), min_size=2, max_size=6),
       world=st.integers(2, 4), rows=st.booleans(), training=st.lists(st.booleans(), min_size=6, max_size=6),
       seed=st.integers(0, 2**16))
def test_packed_reduction_equals_whole_reduction_where_parameters_train(
        shapes, world, rows, training, seed):
    layout = FlatLayout(shapes, world, [ROWS if rows else FLAT] * len(shapes))
    flags = tuple(training[:len(shapes)])
    plans = [plan_subset(layout, flags, r) for r in range(world)]
    if plans[0] is None:
        return  # everything trains, or packing would not pay: the whole shard is reduced
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(layout.padded_numel, dtype=torch.bool)
    for segment in layout.segments():
        if segment.param_index >= 0 and flags[segment.param_index]:
            mask[segment.start:segment.start + segment.length] = True
    # each rank's flat gradient: values where a parameter trains, zeros elsewhere
    grads = [torch.randn(layout.padded_numel, generator=generator, dtype=torch.float64) * mask
             for _ in range(world)]
    whole = torch.stack(grads).sum(0).view(world, layout.shard_numel)
    packed = torch.stack([plans[0].pack(g) for g in grads]).sum(0).view(world, plans[0].chunk)
    assert plans[0].chunk < layout.shard_numel
    for rank in range(world):
        assert plans[rank].chunk == plans[0].chunk  # the same collective on every rank
        assert torch.equal(plans[rank].spread(packed[rank]), whole[rank])


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(),
                                    nn.Linear(40, 5))

    def forward(self, x):
        return self.layers(x)


def _build(sharded: bool) -> tuple[nn.Module, int]:
    """The net (same initial values everywhere), each Linear a unit and the
    root when ``sharded``; and this rank (0 for the one-process reference)."""
    from fsdp_compose import fully_shard
    torch.manual_seed(0)
    model = _Net()
    if not sharded:
        return model, 0
    for layer in model.layers:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, dist.get_rank()


def _freeze_weights(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if name.endswith("weight"):
            p.requires_grad_(False)


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 24, generator=g), torch.randn(rows, 5, generator=g)


def _train(sharded: bool, world: int, steps: int, unfreeze_at: int):
    """Weights frozen after annotation, biases train (SGD with momentum);
    at ``unfreeze_at`` the weights train again. Returns the losses, the
    reduce-scatter bytes of each step and the final parameters."""
    from .._models import full_params
    model, rank = _build(sharded)
    _freeze_weights(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, moved = [], []
    per_rank = 3
    for step in range(steps):
        if step == unfreeze_at:
            model.requires_grad_(True)
        x, y = _batch(step, per_rank * world)
        if sharded:
            x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        with CollectiveCounter() as counter:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        moved.append(counter.bytes[REDUCE_SCATTER])
        optim.step()
        optim.zero_grad()
        if sharded:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    params = full_params(model) if sharded else {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, moved, params


def _sharded_run(steps: int, unfreeze_at: int):
    return _train(True, dist.get_world_size(), steps, unfreeze_at)


def test_weights_frozen_after_annotation_are_not_reduced_and_training_matches():
    world, steps, unfreeze_at = 3, 4, 2
    results = run_distributed(world, _sharded_run, steps, unfreeze_at)
    losses, moved, params = results[0]
    ref_losses, _, ref_params = _train(False, world, steps, unfreeze_at)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-6)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)
    model = _Net()
    biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith("bias"))
    everything = sum(p.numel() for p in model.parameters())
    # the counter sees each reduce-scatter's output: this rank's chunk (fp32)
    # frozen weights: at most the biases (a unit's chunk is its busiest rank's share)
    for step in range(unfreeze_at):
        assert 0 < moved[step] <= biases * 4, (step, moved[step])
    # trainable again: the whole shards
    for step in range(unfreeze_at, steps):
        assert moved[step] >= everything * 4 // world, (step, moved[step])


def _freeze_between_micro_batches(sharded: bool, world: int):
    """Two micro-batches per step, the first without gradient sync while
    the weights train, the weights frozen before the second: the first
    micro-batch's weight gradients must still be reduced and stepped."""
    from .._models import full_params
    model, rank = _build(sharded)
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    per_rank = 2
    for step in range(2):
        model.requires_grad_(True)
        for micro in range(2):
            if micro == 1:
                _freeze_weights(model)
            if sharded:
                model.set_requires_gradient_sync(micro == 1)
            x, y = _batch(10 * step + micro, per_rank * world)
            if sharded:
                x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
            nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        optim.zero_grad()
    if sharded:
        return full_params(model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _sharded_micro_batches():
    return _freeze_between_micro_batches(True, dist.get_world_size())


def test_weights_frozen_between_micro_batches_keep_their_gradient():
    world = 2
    params = run_distributed(world, _sharded_micro_batches)[0]
    reference = _freeze_between_micro_batches(False, world)
    for name, value in reference.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # the weights moved: their first micro-batch's gradient was applied
    torch.manual_seed(0)
    initial = _Net()
    assert not torch.equal(reference["layers.0.weight"], initial.layers[0].weight.detach())
