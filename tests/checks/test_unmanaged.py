"""The forgotten root: parameters the optimizer would update but no unit
manages make the first ``optimizer.step()`` raise on every rank, before any
update, naming them and the fix (``fsdp_compose/checks/unmanaged.py``); the
fix it proposes, and ``mark_reduced_elsewhere`` with a hand-made reduction,
then train as one process does.

Run: ``PYTHONPATH=. python -m pytest -q tests/checks/test_unmanaged.py`` (gloo, 3 ranks).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import fsdp_compose
from fsdp_compose import fully_shard, param_info
from tests._owners import buffer_of
from tests._training import assert_parity, build_model, local_batch, make_optimizer, train_reference
from tests.harness import run_distributed

WORLD = 3
STEPS = 3


def _blocks_only_first_step() -> dict:
    """The blocks annotated, not the root: the first step's error (every
    warning an error, so none may come on the way) and whether anything
    changed."""
    model = build_model()
    for block in model.blocks:
        fully_shard(block)
    optim = make_optimizer(model, "sgd")
    before = {n: p.detach().clone() for n, p in model.named_parameters() if param_info(p) is None}
    shards = [buffer_of(block.ln1.weight).sharded.detach().clone() for block in model.blocks]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x, y = local_batch(0, dist.get_rank(), WORLD)
        model.loss(x, y).backward()
        try:
            optim.step()
            error = None
        except RuntimeError as raised:
            error = str(raised)
    unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before) \
        and all(torch.equal(buffer_of(b.ln1.weight).sharded, s) for b, s in zip(model.blocks, shards))
    return {"error": error, "unchanged": unchanged}


def test_a_forgotten_root_raises_on_every_rank_before_any_update():
    for result in run_distributed(WORLD, _blocks_only_first_step, timeout=120):
        error = result["error"]
        assert error is not None, "the first step did not raise"
        for name in ("'tok_emb.weight'", "'pos_emb.weight'", "'ln_f.weight'", "'head.weight'"):
            assert name in error, error
        assert "fully_shard(model) after the blocks" in error, error
        assert "mark_reduced_elsewhere" in error, error
        assert result["unchanged"], "the step updated parameters before raising"


def _train(how: str) -> dict:
    """``STEPS`` steps of the blocks-annotated model made right per ``how``:
    the fix the error proposes (``root``), or ``mark_reduced_elsewhere`` on
    the root's own parameters, whose gradients this code then averages by
    hand (``marked``, ``marked-module``). The full parameters after training."""
    rank = dist.get_rank()
    model = build_model()
    for block in model.blocks:
        fully_shard(block)
    if how == "root":
        fully_shard(model)  # the fix the message proposes
    unmanaged = [p for p in model.parameters() if param_info(p) is None]
    if how == "marked":
        fsdp_compose.mark_reduced_elsewhere(unmanaged)
    elif how == "marked-module":
        fsdp_compose.mark_reduced_elsewhere(model)  # a module: all its parameters
    optim = make_optimizer(model, "sgd")
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(STEPS):
            x, y = local_batch(step, rank, WORLD)
            loss = model.loss(x, y)
            loss.backward()
            if how != "root":
                for p in unmanaged:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            optim.step()
            optim.zero_grad()
            loss = loss.detach()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            losses.append(loss.item())
    annotated = [model] if how == "root" else list(model.blocks)
    for module in annotated:
        module.unshard(recurse=True)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    for module in annotated:
        module.reshard(recurse=True)
    return {"losses": losses, "params": params, "evals": []}


@pytest.mark.parametrize("how", ["root", "marked", "marked-module"])
def test_the_proposed_fixes_train_as_one_process(how):
    results = run_distributed(WORLD, _train, how, timeout=120)
    assert_parity(results, train_reference(WORLD, "sgd", steps=STEPS))


def _no_error(how: str) -> bool:
    """Two steps where the root's parameters are reduced by another API
    (``replicate``) or left to the user (``ignored_params``): no error."""
    model = build_model()
    if how == "ignored":
        for block in model.blocks:
            fully_shard(block)
        root_own = [p for p in model.parameters() if param_info(p) is None]
        fully_shard(model, ignored_params=root_own)
    else:
        for block in model.blocks:
            fully_shard(block)
        from torch.distributed._composable import replicate
        replicate(model)
    optim = make_optimizer(model, "sgd")
    for step in range(2):
        x, y = local_batch(step, dist.get_rank(), WORLD)
        model.loss(x, y).backward()
        optim.step()
        optim.zero_grad()
    return True


@pytest.mark.parametrize("how", ["replicate", "ignored"])
def test_no_error_where_another_api_or_the_user_reduces(how):
    assert run_distributed(WORLD, _no_error, how, timeout=120) == [True] * WORLD


def test_a_dropped_models_marks_are_forgotten():
    """A mark holds its parameter only while something else does: a dropped
    model's marked parameters are let go (their ids may be reused by a new
    model's, which must not inherit the mark), a live one's are kept."""
    import gc

    from fsdp_compose.checks import unmanaged

    kept, dropped = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    fsdp_compose.mark_reduced_elsewhere(kept)
    fsdp_compose.mark_reduced_elsewhere(dropped)
    ids = {id(p) for p in dropped.parameters()}
    del dropped
    gc.collect()
    fsdp_compose.mark_reduced_elsewhere([])  # any mark or look lets go of the dropped
    assert not ids & set(unmanaged._reduced_elsewhere)
    assert {id(p) for p in kept.parameters()} <= set(unmanaged._reduced_elsewhere)
