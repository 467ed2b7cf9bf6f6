"""Patterns real training code uses, each held to a single-process reference
that trains the same seeded model on the global batch (the concatenation of
every rank's slice, mean loss).

Numbering follows the issue ("What real code does"): 1 sibling-list units
whose modules do not all run, 2 frozen parameters in a module run twice, 3
``requires_grad`` changed after ``fully_shard``. Items 4-9 are in
``test_gradients_and_conversions.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_compose import fully_shard, param_info
from tests._models import (D, HIDDEN, OUT, PER_RANK, SEED, SEQ,
                           assert_parity, build_lm, feature_batch, full_params,
                           global_mean, lm_loss, make_optim, plain_params, rank_slice, rank_world,
                           shard_blocks_and_root, token_batch)
from tests.harness import run_distributed

TIMEOUT = 60
OPTIMS = ["sgd", "adamw"]


# ============================================================================
# 1. A sibling-list unit whose modules do not all run
# ============================================================================
def _annotate_with_sibling_head(model):
    for block in model.blocks:
        fully_shard(block)
    fully_shard([model.norm, model.lm_head])  # one unit of two siblings
    fully_shard(model)


def _hidden_target(step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(n, SEQ, D, generator=g)


def _skip_head_step(model, tokens, target):
    """The forward never calls lm_head: MSE on the final norm's output."""
    h = model(tokens, head=False)
    loss = F.mse_loss(h, target)
    loss.backward()
    return loss


def _chunked_loss_step(model, tokens, targets, n_chunks=4):
    """torchtitan-style: the root forward stops at the norm; the head and the
    loss run chunk by chunk on a detached copy, each chunk with its own
    backward; then the trunk's backward from the collected gradient."""
    h = model(tokens, head=False)
    hd = h.detach().requires_grad_()
    total = 0.0
    for h_chunk, y_chunk in zip(hd.chunk(n_chunks, dim=0), targets.chunk(n_chunks, dim=0)):
        loss_c = lm_loss(model.lm_head(h_chunk), y_chunk) / n_chunks
        loss_c.backward()
        total = total + loss_c.detach()
    h.backward(hd.grad)
    return total


_HEAD_PATTERNS = {"skip-head": _skip_head_step, "chunked-loss": _chunked_loss_step}


def _pattern_batch(pattern, step, n):
    tokens, targets = token_batch(step, n, seed=1)
    return tokens, (_hidden_target(step, n) if pattern == "skip-head" else targets)


def train_sibling_unit(pattern: str, optim_name: str, steps: int, toggle_step: int = -1):
    """Runs on every rank. ``toggle_step``: the step whose forward and backward
    run with the sibling unit's reshard_after_forward/backward set to False
    (set back to True before that step's optimizer step)."""
    rank, world = rank_world()
    model = build_lm()
    _annotate_with_sibling_head(model)
    optim = make_optim(model.parameters(), optim_name)
    losses = []
    for step in range(steps):
        tokens, target = _pattern_batch(pattern, step, world * PER_RANK)
        toggled = step == toggle_step
        if toggled:
            model.norm.set_reshard_after_forward(False)
            model.norm.set_reshard_after_backward(False)
        loss = _HEAD_PATTERNS[pattern](model, rank_slice(tokens, rank, world),
                                       rank_slice(target, rank, world))
        if toggled:
            model.norm.set_reshard_after_forward(True)
            model.norm.set_reshard_after_backward(True)
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss))
    return {"losses": losses, "params": full_params(model)}


def reference_sibling_unit(world: int, pattern: str, optim_name: str, steps: int):
    model = build_lm()
    optim = make_optim(model.parameters(), optim_name)
    losses = []
    for step in range(steps):
        tokens, target = _pattern_batch(pattern, step, world * PER_RANK)
        losses.append(float(_HEAD_PATTERNS[pattern](model, tokens, target).detach()))
        optim.step()
        optim.zero_grad()
    return {"losses": losses, "params": plain_params(model)}


@pytest.mark.parametrize("optim_name", OPTIMS)
def test_sibling_unit_with_module_skipped_in_forward_parity(optim_name):
    """1(a): [norm, lm_head] is one unit but forward never calls lm_head."""
    results = run_distributed(2, train_sibling_unit, "skip-head", optim_name, 2, timeout=TIMEOUT)
    assert_parity(results, reference_sibling_unit(2, "skip-head", optim_name, 2))


@pytest.mark.parametrize("optim_name", OPTIMS)
def test_sibling_unit_chunked_loss_outside_root_forward_parity(optim_name):
    """1(b): lm_head (in the [norm, lm_head] unit) runs 4 times after the
    root's forward, each chunk with its own backward, then the trunk's."""
    results = run_distributed(2, train_sibling_unit, "chunked-loss", optim_name, 2,
                              timeout=TIMEOUT)
    assert_parity(results, reference_sibling_unit(2, "chunked-loss", optim_name, 2))


@pytest.mark.parametrize("pattern", ["skip-head", "chunked-loss"])
def test_sibling_unit_toggling_reshard_flags_between_steps_parity(pattern):
    """1(c): the middle of three steps keeps the sibling unit unsharded after
    forward and after backward."""
    results = run_distributed(2, train_sibling_unit, pattern, "sgd", 3, 1, timeout=TIMEOUT)
    assert_parity(results, reference_sibling_unit(2, pattern, "sgd", 3))


# ============================================================================
# 2. A frozen parameter in a module that runs twice per forward
# ============================================================================
class HalfFrozenBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(HIDDEN, HIDDEN)
        self.trained = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + self.trained(torch.tanh(self.frozen(x)))


class BlockTwiceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, HIDDEN)
        self.block = HalfFrozenBlock()
        self.out = nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.out(self.block(self.block(self.inp(x))))


def _build_block_twice():
    torch.manual_seed(SEED)
    model = BlockTwiceNet()
    model.block.frozen.requires_grad_(False)
    return model


def train_block_twice(optim_name: str, steps: int, world: int = 0):
    """Sharded on every rank (``world == 0``) or the reference (``world`` given)."""
    sharded = world == 0
    rank, world = rank_world() if sharded else (0, world)
    model = _build_block_twice()
    if sharded:
        fully_shard(model.block)
        fully_shard(model)
    optim = make_optim([p for p in model.parameters() if p.requires_grad], optim_name)
    losses = []
    for step in range(steps):
        x, y = feature_batch(step, world * PER_RANK)
        if sharded:
            x, y = rank_slice(x, rank, world), rank_slice(y, rank, world)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss) if sharded else loss.item())
    return {"losses": losses, "params": full_params(model) if sharded else plain_params(model)}


@pytest.mark.parametrize("optim_name", OPTIMS)
def test_frozen_parameter_in_module_run_twice_parity(optim_name):
    results = run_distributed(2, train_block_twice, optim_name, 2, timeout=TIMEOUT)
    assert_parity(results, train_block_twice(optim_name, 2, world=2))


# ============================================================================
# 3. requires_grad changed after fully_shard
# ============================================================================
FREEZE_LATER = ("blocks.0.fc1.weight", "blocks.0.fc1.bias")
UNFREEZE_LATER = ("blocks.1.fc2.weight", "blocks.1.fc2.bias")


def train_changing_requires_grad(change: str, optim_name: str, steps: int, world: int = 0):
    """``change == "freeze"``: blocks.0.fc1 is frozen after step 0;
    ``"unfreeze"``: blocks.1.fc2 is frozen from the start and unfrozen after
    step 0. Sharded on every rank (``world == 0``) or the reference."""
    sharded = world == 0
    rank, world = rank_world() if sharded else (0, world)
    model = build_lm()
    params = dict(model.named_parameters())
    if change == "unfreeze":
        for name in UNFREEZE_LATER:
            params[name].requires_grad_(False)
    if sharded:
        shard_blocks_and_root(model)
    optim = make_optim(model.parameters(), optim_name)  # all of them: grad None is skipped
    grads_none, frozen_values, losses = [], None, []
    for step in range(steps):
        if step == 1:
            for name in (FREEZE_LATER if change == "freeze" else UNFREEZE_LATER):
                params[name].requires_grad_(change == "unfreeze")
            if change == "freeze":
                frozen_values = full_params(model) if sharded else plain_params(model)
        tokens, targets = token_batch(step, world * PER_RANK, seed=3)
        if sharded:
            tokens, targets = rank_slice(tokens, rank, world), rank_slice(targets, rank, world)
        loss = model.loss(tokens, targets)
        loss.backward()
        grads_none.append({n: p.grad is None for n, p in model.named_parameters()})
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss) if sharded else loss.item())
    final = full_params(model) if sharded else plain_params(model)
    local = {n: param_info(p).local_numel if sharded else p.numel()
             for n, p in model.named_parameters()}
    return {"losses": losses, "params": final, "grads_none": grads_none,
            "frozen_values": frozen_values, "local_numel": local}


def _sharded_and_reference(change: str, optim_name: str):
    """Three steps of ``train_changing_requires_grad`` on 2 ranks and in one
    process; parity is checked, the per-rank results are returned."""
    results = run_distributed(2, train_changing_requires_grad, change, optim_name, 3,
                              timeout=TIMEOUT)
    assert_parity(results, train_changing_requires_grad(change, optim_name, 3, world=2))
    return results


@pytest.mark.parametrize("optim_name", OPTIMS)
def test_freezing_after_fully_shard_stops_gradients_and_updates(optim_name):
    """3(a)"""
    for rank, res in enumerate(_sharded_and_reference("freeze", optim_name)):
        for step in (1, 2):
            for name in FREEZE_LATER:
                assert res["grads_none"][step][name], (
                    f"rank {rank}: {name} was frozen after step 0 but has a .grad in step {step}")
        for name in FREEZE_LATER:
            diff = (res["params"][name] - res["frozen_values"][name]).abs().max().item()
            assert diff == 0.0, f"rank {rank}: frozen {name} moved by {diff}"


@pytest.mark.parametrize("optim_name", OPTIMS)
def test_unfreezing_after_fully_shard_trains_the_parameter(optim_name):
    """3(b)"""
    for rank, res in enumerate(_sharded_and_reference("unfreeze", optim_name)):
        for name in UNFREEZE_LATER:
            assert res["grads_none"][0][name], f"rank {rank}: frozen {name} got a .grad"
            if res["local_numel"][name]:
                for step in (1, 2):
                    assert not res["grads_none"][step][name], (
                        f"rank {rank}: {name} was unfrozen after step 0 but got no .grad "
                        f"in step {step}")
