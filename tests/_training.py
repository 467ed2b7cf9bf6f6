"""Training loops shared by the parity tests: one runs on every rank of a
sharded world, the other is the single-process reference on the global batch.

Both build the same seeded model and see the same global batches; each rank
trains on its own slice, so ranks always get different inputs.
"""

from __future__ import annotations

import copy
import functools
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_compose import fully_shard, param_info
from fsdp_compose.testing import GPT, GPTConfig, synthetic_tokens
from tests.harness import TEST_DEVICE

CFG = GPTConfig()
# On CUDA, eps 1e-6 rather than torch's 1e-8: a gradient element near eps
# (blocks.2.attn.qkv has one of 8e-9) turns the rounding of its sum, which
# differs between the global batch and the ranks' halves on the GPU, into a
# 5e-5 update difference (g / (|g| + eps)); seen at 2 ranks on an H200.
ADAM_EPS = 1e-6 if TEST_DEVICE.type == "cuda" else 1e-8
BATCH_PER_RANK = 2
MICRO_BATCHES = 2  # for the accumulation and several-forwards modes


class GPTWithUnused(GPT):
    """GPT plus parameters no forward uses: a whole module (its own unit) and
    one parameter inside block 0 (a unit that is otherwise used)."""

    def __init__(self, cfg: GPTConfig = CFG) -> None:
        super().__init__(cfg)
        self.unused_head = nn.Linear(cfg.d_model, 5)
        self.blocks[0].unused_scale = nn.Parameter(torch.ones(cfg.d_model))


def build_model(variant: str = "gpt") -> nn.Module:
    """The seeded model, initialised on the CPU (the same values whatever the
    device), on ``TEST_DEVICE``."""
    torch.manual_seed(1234)
    if variant == "gpt":
        return _on_test_device(GPT(CFG))
    if variant == "unused":
        return _on_test_device(GPTWithUnused(CFG))
    raise ValueError(variant)


def _on_test_device(model: nn.Module) -> nn.Module:
    """``model`` moved to ``TEST_DEVICE``, unless it was built on the meta
    device (a ``torch.device("meta")`` context) or is there already."""
    device = next(model.parameters()).device
    return model if device.type in ("meta", TEST_DEVICE.type) else model.to(TEST_DEVICE)


def freeze_like_lora(model: nn.Module) -> None:
    """Freeze the big matrices (a LoRA-like split of frozen and trainable
    parameters inside the same units), and all of block 1."""
    for name, p in model.named_parameters():
        if name.endswith("qkv.weight") or name.endswith("mlp.0.weight") or name.startswith("blocks.1."):
            p.requires_grad_(False)


# ------------------------------------------------------------- annotations
def shard_blocks_and_root(model, **kw):
    """The usual annotation: every block (with ``kw``), then the root."""
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model)
    return model


def shard_on_a_new_group(model, timeout_s: float, bucket_cap_mb: float):
    """``model.blocks``, then ``model``, annotated over a new gloo group
    whose collectives time out after ``timeout_s`` (a divergence test must
    not wait for the default timeout), with bucketing at ``bucket_cap_mb``;
    returns the group."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    mesh = DeviceMesh.from_group(group, "cpu")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_bucket_cap_mb(bucket_cap_mb)
    return group


def unbucketed(model):
    """``model`` with bucketing off: one all-gather and one reduce-scatter
    per unit, the structure the per-unit counting tests describe (the
    bucketed one is counted in ``tests/runtime/test_bucketing.py``)."""
    model.set_bucket_cap_mb(0)
    return model


def _siblings(model, **kw):
    fully_shard([model.blocks[0], model.blocks[1]])          # two blocks as ONE unit
    fully_shard(model.blocks[2].mlp[1])                       # a module with no parameters
    fully_shard(model.blocks[2])
    fully_shard([model.tok_emb, model.pos_emb])               # used from the root's forward
    return fully_shard(model)


def _partial(model, **kw):
    fully_shard(model.blocks[0])
    fully_shard(model.blocks[2].attn)
    return fully_shard(model)                                  # blocks[1] stays in the root unit


def _unused(model, **kw):
    fully_shard(model.unused_head)
    return shard_blocks_and_root(model)


def _root_only(model, **kw):
    return fully_shard(model)


RECIPES: dict[str, Callable] = {
    "blocks+root": shard_blocks_and_root,
    "no-reshard-after-forward": lambda m: shard_blocks_and_root(m, reshard_after_forward=False),
    "siblings": _siblings,
    "partial": _partial,
    "unused": _unused,
    "root-only": _root_only,
}


# -------------------------------------------------------------- optimizers
def _original_ndim(p: nn.Parameter) -> int:
    info = param_info(p)
    return len(info.shape) if info is not None else p.ndim


def make_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        decay = [p for p in params if _original_ndim(p) >= 2]
        no_decay = [p for p in params if _original_ndim(p) < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=1e-2, eps=ADAM_EPS)
    if name == "adamw-nanogpt":  # nanoGPT's configure_optimizers, as written for one process
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    raise ValueError(name)


# ------------------------------------------------------------------- loops
def _local(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = tensor.shape[0] // world
    return tensor[rank * per:(rank + 1) * per]


def _micro_count(mode: str) -> int:
    return MICRO_BATCHES if mode in ("accum-sync", "accum-nosync", "accum-keep-unsharded",
                                     "two-forwards") else 1


def global_batch(step: int, world: int, mode: str):
    n = world * BATCH_PER_RANK * _micro_count(mode)
    x, y = synthetic_tokens(step, n, CFG.seq_len, CFG.vocab_size, seed=7)
    return x.to(TEST_DEVICE), y.to(TEST_DEVICE)


def local_batch(step: int, rank: int, world: int, mode: str = "plain"):
    """This rank's slice of ``global_batch``."""
    x, y = global_batch(step, world, mode)
    return _local(x, rank, world), _local(y, rank, world)


def assert_gradients_consistent(model: nn.Module) -> None:
    """Every flat gradient of ``model``'s units is in a consistent state
    ([Note: the states of a flat gradient])."""
    from fsdp_compose.runtime.state import units_below

    for unit in units_below(model):
        for buffer in unit.buffers:
            buffer.grad.assert_consistent()


def _local_step(model, x, y, mode, zero_grad_to_none, optim):
    """One optimizer step on this rank's batch, the way ``mode`` says."""
    micro = _micro_count(mode)
    xs, ys = x.chunk(micro), y.chunk(micro)
    if mode == "two-forwards":
        loss = sum(model.loss(a, b) for a, b in zip(xs, ys)) / micro
        loss.backward()
    elif mode in ("accum-sync", "accum-nosync", "accum-keep-unsharded"):
        loss = 0.0
        for i, (a, b) in enumerate(zip(xs, ys)):
            last = i == micro - 1
            if mode == "accum-nosync":
                model.set_requires_gradient_sync(last)
            if mode == "accum-keep-unsharded":
                model.set_reshard_after_backward(last)
            part = model.loss(a, b) / micro
            part.backward()
            assert_gradients_consistent(model)  # unreduced (no sync) or published
            loss = loss + part.detach()
    else:
        loss = model.loss(x, y)
        loss.backward()
    assert_gradients_consistent(model)
    optim.step()
    optim.zero_grad(set_to_none=zero_grad_to_none)
    assert_gradients_consistent(model)  # released, or kept and zeroed in place
    return loss.detach()


def train_sharded(recipe: str, optim_name: str = "sgd", steps: int = 3, mode: str = "plain",
                  variant: str = "gpt", lora: bool = False, zero_grad_to_none: bool = True,
                  optimizer_before_sharding: bool = False) -> dict:
    """Runs on every rank. Returns the global mean losses, the full
    parameters after training (read through ``unshard``), and the eval
    outputs of ``eval-between`` mode."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(variant)
    if lora:
        freeze_like_lora(model)
    names_before = {n: p for n, p in model.named_parameters()}
    optim = make_optimizer(model, optim_name) if optimizer_before_sharding else None
    RECIPES[recipe](model)
    assert {n: p for n, p in model.named_parameters()} == names_before, "identity/FQNs changed"
    optim = optim or make_optimizer(model, optim_name)
    if mode == "keep-unsharded":
        # never reshard after backward: the next forward must notice that the
        # optimizer changed the shards and gather again
        model.set_reshard_after_backward(False)
    losses, evals = [], []
    for step in range(steps):
        x, y = global_batch(step, world, mode)
        loss = _local_step(model, _local(x, rank, world), _local(y, rank, world), mode,
                           zero_grad_to_none, optim)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
        if mode == "eval-between":
            model.eval()
            with torch.no_grad():
                evals.append(model(_local(x, rank, world)))
            model.train()
    model.unshard(recurse=True)
    full = {n: _attr(model, n).detach().clone() for n in names_before}
    model.reshard(recurse=True)
    grads_none = {n: p.grad is None for n, p in model.named_parameters()}
    return {"losses": losses, "params": full, "evals": evals, "grads_none": grads_none}


def _attr(model: nn.Module, fqn: str) -> torch.Tensor:
    owner, _, name = fqn.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, name)


def train_reference(world: int, optim_name: str = "sgd", steps: int = 3, mode: str = "plain",
                    variant: str = "gpt", lora: bool = False) -> dict:
    """The same training in one process on the global batch."""
    model = build_model(variant)
    if lora:
        freeze_like_lora(model)
    optim = make_optimizer(model, optim_name)
    losses, evals = [], []
    for step in range(steps):
        x, y = global_batch(step, world, mode)
        loss = model.loss(x, y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
        if mode == "eval-between":
            with torch.no_grad():
                evals.append([_local(model(x), r, world).cpu() for r in range(world)])
    params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "evals": evals}


def cached_reference(world: int, optim_name: str = "sgd", steps: int = 3, mode: str = "plain",
                     variant: str = "gpt", lora: bool = False) -> dict:
    """``train_reference``'s result, computed once per distinct arguments in
    this process (it depends on nothing else: seeded model, fixed batches);
    each call returns a copy, so a caller may change what it gets."""
    return copy.deepcopy(_reference_once(world, optim_name, steps, mode, variant, lora))


@functools.cache
def _reference_once(world: int, optim_name: str, steps: int, mode: str, variant: str,
                    lora: bool) -> dict:
    return train_reference(world, optim_name, steps, mode, variant, lora)


def assert_parity(results: list[dict], reference: dict, atol: float = 1e-5) -> float:
    """Every rank matches the reference; returns the worst difference seen."""
    worst = 0.0
    for rank, res in enumerate(results):
        for got, want in zip(res["losses"], reference["losses"]):
            assert abs(got - want) <= atol, f"rank {rank}: loss {got} vs reference {want}"
            worst = max(worst, abs(got - want))
        assert res["params"].keys() == reference["params"].keys()
        for name, want in reference["params"].items():
            got, want = res["params"][name], want.cpu()
            assert got.shape == want.shape, f"{name}: shape {got.shape} vs {want.shape}"
            diff = (got - want).abs().max().item()
            assert diff <= atol, f"rank {rank}: parameter {name} differs by {diff}"
            worst = max(worst, diff)
        for step, outs in enumerate(res["evals"]):
            diff = (outs - reference["evals"][step][rank]).abs().max().item()
            assert diff <= atol, f"rank {rank}: eval output of step {step} differs by {diff}"
    return worst


def gather_master_params(model: nn.Module) -> dict:
    """Full-precision full values of every parameter, gathered from the
    sharded master copies (``unshard()`` would give the compute dtype)."""
    from tests._owners import buffer_of
    gathered = {}
    for name, p in model.named_parameters():
        buffer = buffer_of(p)
        if id(buffer) not in gathered:
            full = torch.empty(buffer.layout.padded_numel, dtype=buffer.dtype)
            dist.all_gather_into_tensor(full, buffer.sharded.detach().cpu())
            gathered[id(buffer)] = full
    out = {}
    for name, p in model.named_parameters():
        buffer = buffer_of(p)
        index = next(i for i, r in enumerate(buffer.records) if r.param is p)
        offset, numel = buffer.layout.offsets[index], buffer.layout.numels[index]
        out[name] = gathered[id(buffer)][offset:offset + numel].view(buffer.layout.shapes[index]).clone()
    return out


def assert_diverged_on_every_rank(results, at_step: int, *expected: str,
                                  start: str = "fully_shard ranks diverged") -> None:
    """Every rank's result is (step, seconds into it, message) of an error
    raised at ``at_step`` within 60 s, starting ``[rank r] <start>`` and
    containing each of ``expected``."""
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} trained through the divergence"
        step, seconds, message = result
        assert step == at_step, f"rank {rank}: raised at step {step}: {message}"
        assert seconds < 60, f"rank {rank} took {seconds:.1f} s"
        assert message.startswith(f"[rank {rank}] {start}"), message
        for text in expected:
            assert text in message, message
