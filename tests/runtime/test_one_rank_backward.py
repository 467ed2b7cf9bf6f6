"""Over one rank a unit whose buffers all train puts no pre-backward hook
on its outputs ([Note: the local path] in
``fsdp_compose/runtime/unit_paths.py``): its first gradient queues the end of
backward, and a forward during a backward is a recomputation. These tests
hold that to what the hooks gave: the same numbers as one process without
fully_shard under activation checkpointing (both implementations), the
gradients published when the loss does not go through the root's output,
and the hooks still there wherever they do work (two ranks, frozen buffers).

Run: ``PYTHONPATH=. python -m pytest -q tests/runtime/test_one_rank_backward.py``
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.harness import run_distributed

TIMEOUT = 120


def _gpt(layers: int = 3) -> nn.Module:
    from fsdp_compose.testing import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=layers))


def _checkpoint_blocks(model: nn.Module, impl: str) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
    kind = CheckpointImpl.REENTRANT if impl == "reentrant" else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(
        model, check_fn=lambda m: m in set(model.blocks),
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=kind))


def _train(model: nn.Module, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    from fsdp_compose.testing import synthetic_tokens
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        tokens, targets = synthetic_tokens(step, 4, 8, 64)
        loss = model.loss(tokens, targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, model


def train_with_checkpointing(impl: str) -> dict:
    """The same GPT trained by one process without fully_shard and with
    every block and the root annotated over one rank, both with each block
    checkpointed (``impl``); losses and parameters of each."""
    from fsdp_compose import fully_shard
    from fsdp_compose.params.full_params import full_params

    reference = _gpt()
    sharded = copy.deepcopy(reference)
    _checkpoint_blocks(reference, impl)
    _checkpoint_blocks(sharded, impl)
    for block in sharded.blocks:
        fully_shard(block)
    fully_shard(sharded)
    ref_losses, reference = _train(reference)
    losses, sharded = _train(sharded)
    with full_params(sharded):
        params = {n: p.detach().clone() for n, p in sharded.named_parameters()}
    return {"ref_losses": ref_losses, "losses": losses, "params": params,
            "ref_params": {n: p.detach().clone() for n, p in reference.named_parameters()}}


@pytest.mark.parametrize("impl", ["no_reentrant", "reentrant"])
def test_checkpointed_blocks_over_one_rank_match_one_process(impl):
    (result,), = [run_distributed(1, train_with_checkpointing, impl, timeout=TIMEOUT)]
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5, abs=1e-6)
    assert result["params"].keys() == result["ref_params"].keys()
    for name, ref in result["ref_params"].items():
        torch.testing.assert_close(result["params"][name], ref, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


def backward_through_one_block() -> dict:
    """A loss from one block called on its own (not through the root's
    output): its gradients are published by the end of backward, which its
    first gradient queued; then the next full step trains as usual."""
    from fsdp_compose import fully_shard
    model = _gpt()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    torch.manual_seed(1)
    x = torch.randn(2, 8, 16)
    model(torch.zeros(2, 8, dtype=torch.long))  # the root's lazy init, under a graph
    model.zero_grad()
    model.blocks[1](x).square().mean().backward()
    published = [n for n, p in model.blocks[1].named_parameters() if p.grad is not None]
    expected = [n for n, _ in model.blocks[1].named_parameters()]
    return {"published": published, "expected": expected}


def test_a_loss_that_bypasses_the_root_still_publishes_its_gradients():
    (result,) = run_distributed(1, backward_through_one_block, timeout=TIMEOUT)
    assert result["published"] == result["expected"]


def pre_backward_runs() -> dict:
    """How many units ran their pre-backward in one step, for a model of
    three blocks and the root, with block 0 frozen."""
    from fsdp_compose import fully_shard
    from fsdp_compose.runtime.unit import Unit
    from fsdp_compose.testing import synthetic_tokens

    model = _gpt()
    model.blocks[0].requires_grad_(False)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    names = []
    original = Unit.pre_backward

    def counted(self):
        names.append("root" if self.is_root else self.name.split("'")[1])
        return original(self)
    tokens, targets = synthetic_tokens(dist.get_rank(), 2, 8, 64)
    model.loss(tokens, targets).backward()  # the first step verifies and warms up
    Unit.pre_backward = counted
    try:
        model.loss(tokens, targets).backward()
    finally:
        Unit.pre_backward = original
    return {"ran": sorted(names)}


@pytest.mark.parametrize("world_size", [1, 2])
def test_pre_backward_hooks_stay_where_they_do_work(world_size):
    """Over two ranks every unit gathers in backward: all four run their
    pre-backward. Over one rank only the root and the unit with a frozen
    block do (its buffers' resharding counts on the unit's backward state);
    the two trainable blocks run none."""
    for result in run_distributed(world_size, pre_backward_runs, timeout=TIMEOUT):
        expected = ["blocks.0", "blocks.1", "blocks.2", "root"] if world_size == 2 else \
            ["blocks.0", "root"]
        assert result["ran"] == expected
