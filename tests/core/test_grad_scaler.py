"""ShardedGradScaler: the inf/nan verdict is agreed by all ranks, and
training with it matches a single-process torch.amp.GradScaler("cpu")."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compose import fully_shard
from fsdp_compose.gradients.clip import clip_grad_norm_
from fsdp_compose.gradients.grad_scaler import ShardedGradScaler
from tests._comm_counter import CollectiveCounter
from tests._training import (_attr, assert_parity, build_model, global_batch, local_batch,
                             make_optimizer, shard_blocks_and_root)
from tests.harness import run_distributed

ALL_REDUCE = str(torch.ops.c10d.allreduce_.default)
INIT_SCALE = 2.0 ** 8  # a power of two: scaling and unscaling are exact in fp32



def _shards(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


def _poison_first_local_grad(model, value=math.inf):
    for p in model.parameters():
        if p.grad is not None and p.grad.numel():
            p.grad.view(-1)[0] = value
            return
    raise AssertionError("this rank holds no gradient to poison")


# ------------------------------------------------ one rank's inf skips everywhere
def _inf_on_one_rank_worker(bad_rank):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    shard_blocks_and_root(model)
    optim = make_optimizer(model, "sgd")
    scaler = ShardedGradScaler("cpu", init_scale=INIT_SCALE)
    out = {}

    x, y = local_batch(0, rank, world)
    scaler.scale(model.loss(x, y)).backward()
    if rank == bad_rank:
        _poison_first_local_grad(model)
    before = _shards(model)
    with CollectiveCounter() as comm:
        scaler.step(optim)
    out["step_counts"] = {str(k): v for k, v in comm.counts.items()}
    with CollectiveCounter() as comm:
        scaler.update()
    out["update_counts"] = {str(k): v for k, v in comm.counts.items()}
    out["skipped_unchanged"] = _same(before, _shards(model))
    out["optimizer_state_empty"] = len(optim.state) == 0
    out["scale_after_inf"] = scaler.get_scale()
    optim.zero_grad()

    # a clean step afterwards runs on every rank
    x, y = local_batch(1, rank, world)
    scaler.scale(model.loss(x, y)).backward()
    before = _shards(model)
    scaler.step(optim)
    scaler.update()
    out["clean_step_changed"] = not _same(before, _shards(model))
    out["state_dict"] = scaler.state_dict()

    # ranks that hold no gradient at all still join the check: a 2-element
    # model leaves every rank but 0 without any local element (chunks are
    # 16-byte aligned: 8 elements here)
    tiny = nn.Linear(1, 1)
    fully_shard(tiny)
    tiny_optim = torch.optim.SGD(tiny.parameters(), lr=0.1)
    tiny_scaler = ShardedGradScaler("cpu", init_scale=INIT_SCALE)
    tiny_scaler.scale(tiny(torch.ones(2, 1)).sum()).backward()
    out["tiny_has_grad"] = any(p.grad is not None and p.grad.numel() for p in tiny.parameters())
    # ranks that own no element still get (empty) gradients: same optimizer state everywhere
    out["tiny_grads_not_none"] = all(p.grad is not None for p in tiny.parameters())
    if rank == 0:
        _poison_first_local_grad(tiny, math.nan)
    before = _shards(tiny)
    tiny_scaler.step(tiny_optim)
    tiny_scaler.update()
    out["tiny_unchanged"] = _same(before, _shards(tiny))
    out["tiny_scale"] = tiny_scaler.get_scale()

    # fused optimizers unscale by themselves (GradScaler's _check_inf_per_device path)
    fused = nn.Linear(8, 7)  # 63 elements: every rank holds some of them at 2 and 4 ranks
    fully_shard(fused)
    fused_optim = torch.optim.AdamW(fused.parameters(), lr=0.1, fused=True)
    fused_scaler = ShardedGradScaler("cpu", init_scale=INIT_SCALE)
    for poison in (True, False):
        fused_scaler.scale(fused(torch.ones(2, 8)).sum()).backward()
        if poison and rank == bad_rank:
            _poison_first_local_grad(fused)
        before = _shards(fused)
        fused_scaler.step(fused_optim)
        fused_scaler.update()
        fused_optim.zero_grad()
        out[f"fused_changed_{poison}"] = not _same(before, _shards(fused))
    out["fused_scale"] = fused_scaler.get_scale()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_inf_on_one_rank_skips_the_step_on_every_rank(world):
    results = run_distributed(world, _inf_on_one_rank_worker, 1)
    for rank, res in enumerate(results):
        assert res["skipped_unchanged"], f"rank {rank} stepped although rank 1 saw an inf"
        assert res["optimizer_state_empty"], rank
        assert res["scale_after_inf"] == INIT_SCALE / 2, rank
        assert res["step_counts"] == {ALL_REDUCE: 1}, res["step_counts"]
        assert res["update_counts"] == {}, res["update_counts"]
        assert res["clean_step_changed"], rank
        assert res["state_dict"] == results[0]["state_dict"]
        assert res["tiny_unchanged"] and res["tiny_scale"] == INIT_SCALE / 2, rank
        assert not res["fused_changed_True"] and res["fused_changed_False"], rank
        assert res["fused_scale"] == INIT_SCALE / 2, rank
    if world == 4:
        assert [r["tiny_has_grad"] for r in results] == [True, False, False, False]
        assert all(r["tiny_grads_not_none"] for r in results)


# ----------------------------------------------- parity with torch's scaler
STEPS = 4
INJECT_STEP = 2
MAX_NORM = 0.3
GROWTH_INTERVAL = 2  # the scale grows after steps 0-1, backs off at step 2


def _scaler_kwargs():
    return dict(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)


def _train_scaled_sharded():
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    shard_blocks_and_root(model)
    optim = make_optimizer(model, "adamw")
    scaler = ShardedGradScaler("cpu", **_scaler_kwargs())
    losses, scales = [], []
    for step in range(STEPS):
        x, y = local_batch(step, rank, world)
        loss = model.loss(x, y)
        scaler.scale(loss).backward()
        if step == INJECT_STEP and rank == world - 1:
            _poison_first_local_grad(model)
        scaler.unscale_(optim)
        clip_grad_norm_(model, MAX_NORM)
        scaler.step(optim)
        scaler.update()
        optim.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        scales.append(scaler.get_scale())
    model.unshard(recurse=True)
    full = {n: _attr(model, n).detach().clone() for n, _ in model.named_parameters()}
    model.reshard(recurse=True)
    return {"losses": losses, "params": full, "evals": [], "scales": scales,
            "state_dict": scaler.state_dict()}


def _train_scaled_reference(world):
    model = build_model()
    optim = make_optimizer(model, "adamw")
    scaler = torch.amp.GradScaler("cpu", **_scaler_kwargs())
    losses, scales = [], []
    for step in range(STEPS):
        x, y = global_batch(step, world, "plain")
        loss = model.loss(x, y)
        scaler.scale(loss).backward()
        if step == INJECT_STEP:
            model.head.weight.grad[0, 0] = math.inf
        scaler.unscale_(optim)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(optim)
        scaler.update()
        optim.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return {"losses": losses, "evals": [], "scales": scales, "state_dict": scaler.state_dict(),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("world", [1, 3])
def test_training_matches_torch_grad_scaler(world):
    results = run_distributed(world, _train_scaled_sharded)
    reference = _train_scaled_reference(world)
    assert reference["scales"] == [INIT_SCALE, 2 * INIT_SCALE, INIT_SCALE, INIT_SCALE]
    assert_parity(results, reference, atol=1e-5)
    for res in results:
        assert res["scales"] == reference["scales"]
        assert res["state_dict"] == reference["state_dict"]


# ---------------------------------------------------------- single process
def test_single_process_is_torch_grad_scaler_and_state_dict_round_trips():
    assert ShardedGradScaler().is_enabled()  # default device: cuda if available, else cpu
    torch.manual_seed(0)
    models = [nn.Linear(3, 2) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    scalers = [torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1),
               ShardedGradScaler("cpu", init_scale=4.0, growth_interval=1)]
    x = torch.randn(5, 3)
    for step in range(3):
        for model, optim, scaler in zip(models, optims, scalers):
            scaler.scale(model(x).square().mean()).backward()
            if step == 1:
                model.weight.grad[0, 0] = math.nan
            scaler.step(optim)
            scaler.update()
            optim.zero_grad()
        assert scalers[0].state_dict() == scalers[1].state_dict()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    fresh = ShardedGradScaler("cpu")
    fresh.load_state_dict(scalers[1].state_dict())
    assert fresh.state_dict() == scalers[1].state_dict()
