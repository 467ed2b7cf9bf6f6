"""``fsdp_compose.full_params``: whole parameters inside a
block, each rank keeping its slice of what was written.

Every use is held to one process doing the same on the unsharded model:
initialisation after ``to_empty`` (world size 3, uneven shapes, then training
with SGD-momentum and AdamW), an EMA copy, weight surgery, and greedy
generation; then the options and every error.

Run: ``PYTHONPATH=. python -m pytest -q tests/core/test_full_params.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compose import MixedPrecisionPolicy, full_params, fully_shard, param_info
from tests._comm_counter import CollectiveCounter
from tests._models import (D, PER_RANK, SEQ, VOCAB, TinyLM, assert_dicts_close, build_lm,
                           global_mean, lm_loss, make_optim, plain_params, rank_slice, rank_world,
                           token_batch)
from tests.harness import run_distributed

TIMEOUT = 90
INIT_SEED = 77
DATA_SEED = 23
EMA_DECAY = 0.25


# ------------------------------------------------------------------ helpers
def init_weights(model: nn.Module) -> None:
    """A torchtitan-style initialiser that needs whole parameters: random
    values of the whole shape, constants, and one whole-value copy."""
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif name.startswith("norm."):
            nn.init.ones_(p)
        elif name == "lm_head.weight":
            p.copy_(0.05 * torch.arange(p.numel()).float().sin().view(p.shape))  # a full value
        else:
            nn.init.trunc_normal_(p, std=0.02)


def _shard(model: nn.Module, **kw) -> nn.Module:
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, read through ``full_params`` itself."""
    with full_params(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _local_batch(step: int):
    rank, world = rank_world()
    tokens, targets = token_batch(step, world * PER_RANK, seed=DATA_SEED)
    return rank_slice(tokens, rank, world), rank_slice(targets, rank, world)


def _step(model: nn.Module, optim: torch.optim.Optimizer, tokens, targets) -> float:
    """One training step; the loss of the global batch (mean over ranks)."""
    loss = model.loss(tokens, targets)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return global_mean(loss) if dist.is_initialized() else loss.item()


# ============================================================================
# init after to_empty, then training
# ============================================================================
def meta_init_and_train(optim_name: str, steps: int = 3) -> dict:
    with torch.device("meta"):
        model = TinyLM(2)
    _shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        with pytest.raises(RuntimeError):  # what frameworks hit without full_params: shards
            model.lm_head.weight.copy_(torch.zeros(VOCAB, D))
        torch.manual_seed(INIT_SEED)
        with full_params(model):
            shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
            init_weights(model)
    for p in model.parameters():  # shards again, in the default's local shape (rows_here, *rest)
        info = param_info(p)
        assert p.dim() == len(info.shape) and p.shape[1:] == info.shape[1:], p.shape
        assert p.numel() == info.local_numel, (p.shape, info)
    assert model.lm_head.weight.shape[0] < VOCAB  # not whole: 97 rows over 3 ranks
    initial = _whole(model)
    optim = make_optim(model.parameters(), optim_name)
    losses = [_step(model, optim, *_local_batch(step)) for step in range(steps)]
    return {"shapes": shapes, "initial": initial, "losses": losses, "params": _whole(model)}


def reference_init_and_train(world: int, optim_name: str, steps: int = 3) -> dict:
    model = TinyLM(2)
    torch.manual_seed(INIT_SEED)
    with torch.no_grad():
        init_weights(model)
    initial = plain_params(model)
    optim = make_optim(model.parameters(), optim_name)
    losses = []
    for step in range(steps):
        losses.append(_step(model, optim, *token_batch(step, world * PER_RANK, seed=DATA_SEED)))
    return {"initial": initial, "losses": losses, "params": plain_params(model)}


@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_init_after_to_empty_inside_full_params_then_train(optim_name):
    world = 3
    results = run_distributed(world, meta_init_and_train, optim_name, timeout=TIMEOUT)
    want = reference_init_and_train(world, optim_name)
    for rank, got in enumerate(results):
        assert got["shapes"] == {n: tuple(p.shape) for n, p in want["initial"].items()}
        for name, value in want["initial"].items():  # the same RNG calls on the same shapes
            assert torch.equal(got["initial"][name], value), f"rank {rank}: {name}"
        for step, (a, b) in enumerate(zip(got["losses"], want["losses"])):
            assert abs(a - b) <= 1e-5, f"rank {rank}, step {step}: loss {a} vs {b}"
        assert_dicts_close(got["params"], want["params"], 1e-5, f"rank {rank}: ")


# ============================================================================
# EMA copy (writeback=False) and weight surgery (writeback=True)
# ============================================================================
def _surgery(model: nn.Module) -> None:
    """Tie-initialise the head from the embedding, zero one row through
    ``.data`` (Hugging Face initialisers write through ``.data``), scale a
    slice in place."""
    model.lm_head.weight.copy_(model.tok_emb.weight)
    model.blocks[1].fc1.weight.data[3].zero_()
    model.blocks[0].fc2.weight[:, 2:5].mul_(0.5)


def ema_and_surgery(offload_to_cpu: bool, steps: int = 3) -> dict:
    model = _shard(build_lm(2))
    with torch.no_grad(), full_params(model):
        _surgery(model)
    with torch.no_grad(), full_params(model, writeback=False, offload_to_cpu=offload_to_cpu):
        ema = {n: p.detach().clone() for n, p in model.named_parameters()}
        devices = {p.device.type for p in model.parameters()}
    optim = make_optim(model.parameters(), "sgd")
    losses = []
    for step in range(steps):
        losses.append(_step(model, optim, *_local_batch(step)))
        with torch.no_grad(), full_params(model, writeback=False, offload_to_cpu=offload_to_cpu):
            for n, p in model.named_parameters():
                ema[n].lerp_(p, EMA_DECAY)
            p.add_(1.0)  # not written back
    return {"ema": ema, "losses": losses, "params": _whole(model), "devices": devices}


def reference_ema_and_surgery(world: int, steps: int = 3) -> dict:
    model = build_lm(2)
    with torch.no_grad():
        _surgery(model)
    ema = plain_params(model)
    optim = make_optim(model.parameters(), "sgd")
    losses = []
    for step in range(steps):
        losses.append(_step(model, optim, *token_batch(step, world * PER_RANK, seed=DATA_SEED)))
        for n, p in model.named_parameters():
            ema[n].lerp_(p.detach(), EMA_DECAY)
    return {"ema": ema, "losses": losses, "params": plain_params(model)}


@pytest.mark.parametrize("offload_to_cpu", [False, True])
def test_ema_copy_and_weight_surgery(offload_to_cpu):
    world = 3
    results = run_distributed(world, ema_and_surgery, offload_to_cpu, timeout=TIMEOUT)
    want = reference_ema_and_surgery(world)
    for rank, got in enumerate(results):
        assert got["devices"] == {"cpu"}
        for step, (a, b) in enumerate(zip(got["losses"], want["losses"])):
            assert abs(a - b) <= 1e-5, f"rank {rank}, step {step}: loss {a} vs {b}"
        assert_dicts_close(got["params"], want["params"], 1e-5, f"rank {rank}: ")
        assert_dicts_close(got["ema"], want["ema"], 1e-5, f"rank {rank}: EMA of ")


# ============================================================================
# generation: forward inside the block reads whole parameters, no collective
# ============================================================================
def greedy(model: nn.Module, prompt: torch.Tensor, new_tokens: int = 4) -> torch.Tensor:
    tokens = prompt
    for _ in range(new_tokens):
        next_token = model(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], dim=1)
    return tokens


def _prompt(rank: int) -> torch.Tensor:
    return torch.randint(VOCAB, (1 + rank, SEQ), generator=torch.Generator().manual_seed(rank))


def generate_inside_full_params() -> dict:
    """Each rank generates from its own prompt (a different batch size per
    rank), before the first training forward and after two steps."""
    rank, _ = rank_world()
    model = _shard(build_lm(2), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    out = {}
    with torch.no_grad(), full_params(model, writeback=False), CollectiveCounter() as counter:
        out["before"] = greedy(model, _prompt(rank))
        out["dtype"] = model.lm_head.weight.dtype  # whole fp32 values, not the bf16 copy
    out["collectives_in_generation"] = sum(counter.counts.values())
    optim = make_optim(model.parameters(), "sgd")
    for step in range(2):
        _step(model, optim, *_local_batch(step))
    with torch.no_grad(), full_params(model, writeback=False):
        out["after"] = greedy(model, _prompt(rank))
    return out


def reference_generation(world: int) -> list[dict]:
    model = build_lm(2)
    with torch.no_grad():
        before = [greedy(model, _prompt(r)) for r in range(world)]
    # the reference of the bf16 training: the same recipe, one process
    _shard_free_bf16_steps(model, world, steps=2)
    with torch.no_grad():
        after = [greedy(model, _prompt(r)) for r in range(world)]
    return [{"before": b, "after": a} for b, a in zip(before, after)]


def _shard_free_bf16_steps(model: nn.Module, world: int, steps: int) -> None:
    """SGD steps whose forward/backward run on a bf16 copy (what
    ``param_dtype=bf16`` computes), gradients applied to the fp32 master."""
    optim = make_optim(model.parameters(), "sgd")
    for step in range(steps):
        tokens, targets = token_batch(step, world * PER_RANK, seed=DATA_SEED)
        low = build_lm(2).to(torch.bfloat16)
        low.load_state_dict({n: p.detach().to(torch.bfloat16)
                             for n, p in model.named_parameters()})
        grads = []
        for r in range(world):  # per-rank mean losses, averaged: the sharded recipe
            low.zero_grad()
            lm_loss(low(rank_slice(tokens, r, world)), rank_slice(targets, r, world)).backward()
            grads.append({n: p.grad.float() for n, p in low.named_parameters()})
        for n, p in model.named_parameters():
            p.grad = sum(g[n] for g in grads) / world
        optim.step()
        optim.zero_grad()


def test_generation_inside_full_params():
    world = 2
    results = run_distributed(world, generate_inside_full_params, timeout=TIMEOUT)
    want = reference_generation(world)
    for rank, got in enumerate(results):
        assert got["collectives_in_generation"] == 0
        assert got["dtype"] == torch.float32
        assert torch.equal(got["before"], want[rank]["before"])
        assert torch.equal(got["after"], want[rank]["after"])


# ============================================================================
# options and errors
# ============================================================================
def options_and_errors() -> dict:
    rank, world = rank_world()
    model = _shard(build_lm(2))
    before = _whole(model)
    full = {n: tuple(param_info(p).shape) for n, p in model.named_parameters()}
    local = {n: tuple(p.shape) for n, p in model.named_parameters()}  # this rank's shards
    out = {"full": full, "local": local}
    with pytest.raises(ValueError, match="writeback=False"):
        with full_params(model, rank0_only=True):
            pass
    with full_params(model, rank0_only=True, writeback=False):
        out["rank0_only_shapes"] = {n: tuple(p.shape) for n, p in model.named_parameters()}
        if rank != 0:
            with pytest.raises(RuntimeError, match="rank0_only"), torch.no_grad():
                model(_prompt(rank))
    with full_params(model.blocks[0], recurse=False):
        out["recurse_false_shapes"] = [tuple(model.blocks[0].fc1.weight.shape),
                                       tuple(model.blocks[1].fc1.weight.shape),
                                       tuple(model.lm_head.weight.shape)]
    with pytest.raises(ValueError, match="recurse=False"):
        with full_params(model.blocks[0].fc1, recurse=False):
            pass
    with full_params(model):
        with pytest.raises(RuntimeError, match="already held whole"):
            with full_params(model.blocks[1]):
                pass
        with pytest.raises(RuntimeError, match="torch.no_grad"):
            model(_prompt(rank))
    with pytest.raises(RuntimeError, match=r"ranks \[1\] hold different values than rank 0") as e:
        with torch.no_grad(), full_params(model):
            model.blocks[1].fc2.bias.fill_(float(rank == 1))  # rank-dependent write
    out["different_values_names"] = "blocks.1.fc1.weight" in str(e.value)
    with pytest.raises(KeyError):
        with torch.no_grad(), full_params(model):
            model.lm_head.weight.zero_()
            raise KeyError("a rank raising inside the block")
    out["unchanged"] = all(torch.equal(v, before[n]) for n, v in _whole(model).items())
    loss = model.loss(*_local_batch(0))
    with pytest.raises(RuntimeError, match="whose backward may still read it"):
        with full_params(model):
            pass
    loss.backward()
    with torch.device("meta"):
        meta = _shard(TinyLM(1))
    with pytest.raises(RuntimeError, match="meta device"):
        with full_params(meta):
            pass
    return out


def test_options_and_errors():
    results = run_distributed(3, options_and_errors, timeout=TIMEOUT)
    for rank, out in enumerate(results):
        full, local = out["full"], out["local"]
        assert out["rank0_only_shapes"] == (full if rank == 0 else local)
        names = ["blocks.0.fc1.weight", "blocks.1.fc1.weight", "lm_head.weight"]
        assert all(local[n] != full[n] for n in names), local  # shards differ from whole
        assert out["recurse_false_shapes"] == [full[names[0]], local[names[1]], local[names[2]]]
        assert out["different_values_names"] and out["unchanged"]
