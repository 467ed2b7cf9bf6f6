"""After an exception: ``reset_iter_state()`` recovers a model whose forward
or backward raised on every rank; a rank that fails alone ends the run
promptly instead of leaving the others waiting; the opt-in non-finite
gradient check names the same parameter on every rank.

Run: ``PYTHONPATH=. python -m pytest -q tests/core/test_recovery.py``
"""

import functools
import time

import pytest
import torch
import torch.distributed as dist

from fsdp_compose import check_finite_gradients, param_info
from fsdp_compose.runtime.state import units_below
from fsdp_compose.runtime.training_state import TrainingState
from tests._comm_counter import ALL_REDUCE as AR, CollectiveCounter
from tests._training import (build_model, gather_master_params, local_batch, make_optimizer,
                             shard_blocks_and_root)
from tests.harness import DistributedTestError, run_distributed


class Injected(RuntimeError):
    """The simulated failure."""


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise Injected("raised in backward")


def _arm(model, where: str, armed: dict) -> None:
    """Raise midway through forward (inside block 1, after block 0 and
    block 1 were unsharded), midway through backward (in block 1's attention
    backward, after block 2 reduced its gradients and while block 0 may be
    prefetched), or in the loss function (after forward)."""
    if where == "forward":
        def pre_hook(module, args):
            if armed["on"]:
                raise Injected("raised in forward")
        model.blocks[1].mlp.register_forward_pre_hook(pre_hook)
    elif where == "backward":
        def hook(module, args, output):
            return _RaiseInBackward.apply(output) if armed["on"] else output
        model.blocks[1].attn.register_forward_hook(hook)


def _assert_clean(model) -> None:
    for unit in units_below(model):
        assert unit.training_state is TrainingState.IDLE, unit
        assert not unit.is_unsharded, unit
        for buffer in unit.buffers:
            assert not buffer.is_gathering and not buffer.grad.has_unpublished
            assert not buffer.grad.has_unreduced and not any(buffer.grad.used)
    for name, p in model.named_parameters():  # module attributes are the originals again
        assert isinstance(p, torch.nn.Parameter), name
        # this rank's piece under the default ("rows"): (rows_here, *rest), keeping ndim
        info = param_info(p)
        assert p.ndim == len(info.shape) and p.shape[1:] == info.shape[1:], (name, p.shape)
        assert p.numel() == info.local_numel, name


def train_with_failure(optim_name: str, where: str, explicit: bool = True, fail_at: int = 1,
                       steps: int = 4) -> dict:
    """``where == "skip"``: the reference, which skips step ``fail_at``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard_blocks_and_root(build_model())
    optim = make_optimizer(model, optim_name)
    armed = {"on": False}
    _arm(model, where, armed)
    told = ""
    for step in range(steps):
        x, y = local_batch(step, rank, world)
        if step == fail_at and where == "skip":
            continue
        if step == fail_at:
            armed["on"] = True
            with pytest.raises(Injected):
                loss = model.loss(x, y)
                if where == "loss":
                    raise Injected("raised in the loss function")
                loss.backward()
            armed["on"] = False
            if where in ("forward", "backward"):  # left mid-iteration: optimizer.step() refuses
                try:
                    optim.step()
                except RuntimeError as exc:
                    told = str(exc)
            if explicit:
                model.reset_iter_state()
            else:  # the next forward resets, with a warning
                with pytest.warns(UserWarning, match="previous iteration did not finish"):
                    with torch.no_grad():
                        model(x)
            _assert_clean(model)
            optim.zero_grad()
            continue
        model.loss(x, y).backward()
        optim.step()
        optim.zero_grad()
    _assert_clean(model)
    return {"params": gather_master_params(model), "told": told}


@functools.cache
def _skipping_the_step(optim_name: str) -> dict:
    """The reference's parameters (the same training skipping step 1), run
    once per optimizer: the tests below only read them."""
    return run_distributed(2, train_with_failure, optim_name, "skip")[0]["params"]


@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
@pytest.mark.parametrize("where,explicit", [("forward", True), ("backward", True),
                                            ("loss", True), ("backward", False)])
def test_reset_iter_state_equals_skipping_the_step(optim_name, where, explicit):
    """Explicit reset_iter_state(), or the next forward resetting by itself."""
    want = _skipping_the_step(optim_name)
    results = run_distributed(2, train_with_failure, optim_name, where, explicit)
    for rank, got in enumerate(results):
        for name, value in want.items():
            assert torch.equal(got["params"][name], value), (rank, name)
        if where in ("forward", "backward"):
            assert "optimizer.step() while" in got["told"], got["told"]
            assert "reset_iter_state()" in got["told"]


def backward_twice():
    """The second backward over one graph raises torch's error on every rank;
    reset_iter_state() makes the model train again."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard_blocks_and_root(build_model())
    optim = make_optimizer(model, "sgd")
    x, y = local_batch(0, rank, world)
    loss = model.loss(x, y)
    loss.backward()
    try:
        loss.backward()
    except RuntimeError as exc:
        message = str(exc)
    else:
        raise AssertionError("no error from the second backward")
    model.reset_iter_state()
    optim.step()  # the first backward's gradients were published: a valid step
    optim.zero_grad()
    before = gather_master_params(model)
    model.loss(x, y).backward()
    optim.step()
    after = gather_master_params(model)
    assert all(not torch.equal(before[n], after[n]) for n in before)
    return message


def test_backward_twice_raises_everywhere_and_reset_recovers():
    for message in run_distributed(2, backward_twice):
        assert "backward through the graph a second time" in message


# ------------------------------------------------------ a rank failing alone
def fail_alone(where: str) -> None:
    """Rank 1 raises in forward or backward of step 1; rank 0 goes on into
    the collectives of that step and would wait for rank 1 for ever."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard_blocks_and_root(build_model())
    armed = {"on": False}
    _arm(model, where, armed)
    for step in range(3):
        armed["on"] = rank == 1 and step == 1
        x, y = local_batch(step, rank, world)
        model.loss(x, y).backward()


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_rank_failing_alone_is_reported_promptly(where):
    run_distributed(2, _noop)  # start the pool outside the timing
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(2, fail_alone, where)  # harness timeout: 90 s
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert f"Injected: raised in {where}" in message.split("[rank 1]", 1)[1]
    assert "rank(s) [0] still running" in message and "after rank(s) [1] raised" in message
    assert elapsed < 30, elapsed


def _noop():
    return None


# ------------------------------------------------------ non-finite gradients
def nonfinite_gradients(enabled: bool, set_on_block: bool = False) -> dict:
    """NaNs injected (by post-accumulate-grad hooks, which run at publication)
    into rank 1's shard of ``blocks.0.mlp.2.weight`` and into rank 0's
    shard of a later parameter: every rank names the earlier one. The
    setting is the model's: made on a block before the first forward, it
    checks the whole model the same way."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard_blocks_and_root(build_model())
    optim = make_optimizer(model, "sgd")
    (model.blocks[2] if set_on_block else model).set_check_finite_gradients(enabled)
    params = dict(model.named_parameters())
    first, later = params["blocks.0.mlp.2.weight"], params["blocks.2.attn.qkv.weight"]
    assert param_info((later, first)[rank]).local_numel > 0  # the end / start of a buffer
    poison = {"on": False}

    def inject(owner_rank):
        def hook(p):
            if poison["on"] and rank == owner_rank:
                p.grad[0] = float("nan")
        return hook

    first.register_post_accumulate_grad_hook(inject(1))
    later.register_post_accumulate_grad_hook(inject(0))
    x, y = local_batch(0, rank, world)
    model.loss(x, y).backward()  # a clean step: nothing raised
    optim.step()
    optim.zero_grad()
    with CollectiveCounter() as comm:
        model.loss(x, y).backward()
    all_reduces = comm.counts.get(AR, 0)
    optim.zero_grad()
    poison["on"] = True
    message = ""
    try:
        model.loss(x, y).backward()
    except RuntimeError as exc:
        message = str(exc)
    poison["on"] = False
    direct = ""
    try:
        check_finite_gradients(model)  # the same check on demand
    except RuntimeError as exc:
        direct = str(exc)
    optim.zero_grad()  # skip the step: the model is usable
    model.loss(x, y).backward()
    optim.step()
    _assert_clean(model)
    return {"message": message, "direct": direct, "all_reduces": all_reduces}


def test_nonfinite_gradient_is_named_on_every_rank():
    off, on = run_distributed(2, nonfinite_gradients, False), \
        run_distributed(2, nonfinite_gradients, True)
    assert run_distributed(2, nonfinite_gradients, True, True) == on
    for res in on:
        assert "'blocks.0.mlp.2.weight' is not finite" in res["message"], res["message"]
        assert "rank 1's shard" in res["message"]
        assert res["direct"] == res["message"]
    assert all(res["message"] == "" for res in off)
    assert on[0]["message"] == on[1]["message"]
    # one tiny all-reduce per step (the used flags), plus exactly one for the check when on
    assert [r["all_reduces"] for r in off] == [1, 1]
    assert [r["all_reduces"] for r in on] == [2, 2]
