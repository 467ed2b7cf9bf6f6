"""Training parity: sharded training on F ranks equals one process training
on the global batch (fp32, SGD with momentum and AdamW with two groups)."""

import pytest

from tests._training import assert_parity, cached_reference, train_sharded
from tests.harness import run_distributed

ATOL = 1e-5


def _check(world, recipe, optim="sgd", mode="plain", variant="gpt", lora=False, **kw):
    results = run_distributed(world, train_sharded, recipe, optim, 3, mode, variant, lora, **kw)
    reference = cached_reference(world, optim, 3, mode, variant, lora)
    return assert_parity(results, reference, ATOL)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_blocks_and_root(world, optim):
    _check(world, "blocks+root", optim)


@pytest.mark.parametrize("recipe", ["siblings", "partial", "root-only", "no-reshard-after-forward"])
@pytest.mark.parametrize("world", [2, 3])
def test_annotation_recipes(recipe, world):
    _check(world, recipe, "sgd")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_frozen_and_trainable_in_one_unit(world, optim):
    _check(world, "blocks+root", optim, lora=True)


@pytest.mark.parametrize("mode", ["accum-sync", "accum-nosync", "accum-keep-unsharded",
                                  "keep-unsharded", "two-forwards", "eval-between"])
def test_step_modes(mode):
    _check(3, "blocks+root", "sgd", mode)


@pytest.mark.parametrize("zero_grad_to_none", [True, False])
def test_zero_grad_variants_and_optimizer_built_before_sharding(zero_grad_to_none):
    _check(2, "blocks+root", "sgd", zero_grad_to_none=zero_grad_to_none,
           optimizer_before_sharding=True)


def test_accumulation_without_sync_with_adamw_and_frozen():
    _check(2, "no-reshard-after-forward", "adamw", "accum-nosync", lora=True)


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_unused_parameters(optim):
    # A unit no forward uses, and an unused parameter inside a used unit:
    # both keep .grad None as in one process, so AdamW's weight decay leaves
    # them alone (tests/core/test_real_code.py checks .grad inside the step).
    results = run_distributed(2, train_sharded, "unused", optim, 3, "plain", "unused")
    reference = cached_reference(2, optim, 3, "plain", "unused")
    assert_parity(results, reference, ATOL)
