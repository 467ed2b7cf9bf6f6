"""Placements at run time: local shapes between iterations, ``.grad`` on
non-owners, and training parity against one process on the global batch
(fp32, SGD with momentum and AdamW, uneven shapes, world sizes 2 and 3).

Run: PYTHONPATH=$PWD python -m pytest -q tests/test_placements.py
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard

from fsdp_compose import Blocks, fully_shard, param_info
from tests._training import (_attr, _local, _local_step, assert_parity, build_model, global_batch,
                             make_optimizer, train_reference)
from tests.harness import run_distributed

ATOL = 1e-5
PLACEMENTS = {  # name -> (unit placement, shard_placement_fn kind)
    "rows": ("rows", None),
    "blocks2": (Blocks(2), None),
    "owned": ("owned", None),
    "shard0": ("flat", "shard0"),
    "shard1": ("flat", "shard1"),
    "owned-matrices": ("rows", "owned-2d"),
}


def _placement_fn(kind):
    """Module-level choices (the harness pickles arguments, not lambdas)."""
    if kind is None:
        return None
    if kind == "shard0":
        return lambda p: Shard(0) if p.ndim >= 1 else None
    if kind == "shard1":  # FSDP2's MoE recipe: dim 1 where there is one
        return lambda p: Shard(1) if p.ndim == 2 else Shard(0)
    if kind == "owned-2d":
        return lambda p: "owned" if p.ndim == 2 else None
    raise ValueError(kind)


def shard_with(model: nn.Module, name: str) -> nn.Module:
    placement, kind = PLACEMENTS[name]
    for block in model.blocks:
        fully_shard(block, placement=placement, shard_placement_fn=_placement_fn(kind))
    fully_shard(model, placement=placement, shard_placement_fn=_placement_fn(kind))
    return model


def _expected_local_ndim(name: str, full_ndim: int) -> int:
    if name == "shard0" or name == "shard1":
        return full_ndim
    return full_ndim if full_ndim else 1  # a 0-dim parameter stays flat


def train_placed(name: str, optim_name: str, steps: int = 3, mode: str = "plain") -> dict:
    """Runs on every rank: the parity loop of tests/_training.py with a placement."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model("gpt")
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shard_with(model, name)
    optim = make_optimizer(model, optim_name)
    losses, local_shapes, grads_none = [], {}, {}
    for step in range(steps):
        x, y = global_batch(step, world, mode)
        model.zero_grad()
        loss = _local_step(model, _local(x, rank, world), _local(y, rank, world), mode,
                           False, optim)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    model.unshard(recurse=True)  # right after the step: nothing may read stale values
    full = {n: _attr(model, n).detach().clone() for n in full_shapes}
    model.reshard(recurse=True)
    # shapes between iterations, and which ranks got a .grad in the last backward
    x, y = global_batch(0, world, mode)
    optim.zero_grad(set_to_none=True)
    model.loss(_local(x, rank, world), _local(y, rank, world)).backward()
    for n, p in model.named_parameters():
        info = param_info(p)
        assert info.shape == full_shapes[n]
        local_shapes[n] = tuple(p.shape)
        grads_none[n] = p.grad is None
        if p.grad is not None:
            assert p.grad.shape == p.shape, n
        assert p.ndim == _expected_local_ndim(name, len(full_shapes[n])), (n, p.shape)
    optim.zero_grad(set_to_none=True)
    return {"losses": losses, "params": full, "evals": [], "local_shapes": local_shapes,
            "grads_none": grads_none, "full_shapes": full_shapes}


def _check_shapes(name: str, results: list[dict]) -> None:
    world = len(results)
    for n, shape in results[0]["full_shapes"].items():
        local = [r["local_shapes"][n] for r in results]
        if name in ("shard0", "shard1") and len(shape):
            d = 1 if name == "shard1" and len(shape) == 2 else 0
            expected = [tuple(c.shape) for c in torch.empty(shape).chunk(world, d)]
            expected += [tuple(shape[:d]) + (0,) + tuple(shape[d + 1:])] * (world - len(expected))
            assert local == expected, (n, local)
            continue
        if len(shape) == 0:
            continue
        assert all(s[1:] == shape[1:] for s in local), (n, local)  # whole rows
        assert sum(s[0] for s in local) == shape[0], (n, local)
        owned = name == "owned" or (name == "owned-matrices" and len(shape) == 2)
        if owned:
            assert sorted(s[0] for s in local)[:-1] == [0] * (world - 1), (n, local)
        for r, s in zip(results, local):  # holds none: .grad is None (any non-flat placement)
            if s[0] == 0:
                assert r["grads_none"][n], (n, local)
            else:
                assert not r["grads_none"][n], (n, local)


@pytest.mark.parametrize("name", list(PLACEMENTS))
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_parity_and_local_shapes(name, world, optim):
    results = run_distributed(world, train_placed, name, optim)
    assert_parity(results, train_reference(world, optim, 3), ATOL)
    _check_shapes(name, results)
