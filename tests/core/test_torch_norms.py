"""torch's ``clip_grad_norm_`` / ``get_total_norm`` over managed gradients
give the global result (``fsdp_compose/torch_norms.py``).

Held to torch's functions on one process with the global batch: both entry
points, ``foreach`` on and off, 2-, 1- and inf-norms, frozen and ignored
parameters, world size 3 on uneven shapes (some ranks own no element of a
parameter and pass its empty gradient), one all-reduce per call, training
with SGD-momentum and AdamW clipped by torch's function, and a reference
imported before ``fully_shard`` ran. Turning the routing off shows what the
routing prevents: per-rank local norms.

Run: ``PYTHONPATH=. python -m pytest -q tests/core/test_torch_norms.py``.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard
from torch.nn.utils import clip_grad_norm_ as early_clip_grad_norm_  # before any fully_shard
from torch.nn.utils import get_total_norm as early_get_total_norm

import fsdp_compose
from fsdp_compose import Blocks, fully_shard, param_info, route_torch_grad_norms
from tests._comm_counter import ALL_REDUCE, CollectiveCounter
from tests._models import (PER_RANK, assemble_grads, assert_dicts_close, build_lm, global_mean,
                           make_optim, plain_params, rank_slice, rank_world,
                           token_batch)
from tests.harness import run_distributed

WORLD = 3
TIMEOUT = 90
MAX_NORM = 0.05  # far below the gradients' norm: clipping always bites
CLIP = 0.2  # the training tests clip at this (gradient norms ~0.4)
NORM_TYPES = [2.0, 1.0, math.inf]
FROZEN = ("blocks.1.fc1.weight", "norm.weight")
IGNORED = "blocks.0.fc2.bias"
DATA_SEED = 5


def _model() -> nn.Module:
    model = build_lm(2)
    for name, p in model.named_parameters():
        if name in FROZEN:
            p.requires_grad_(False)
    return model


def _annotate(model: nn.Module) -> nn.Module:
    fully_shard(model.blocks[0], ignored_params={model.blocks[0].fc2.bias})
    fully_shard(model.blocks[1])
    fully_shard(model)
    return model


def _batch(step: int):
    rank, world = rank_world()
    tokens, targets = token_batch(step, world * PER_RANK, seed=DATA_SEED)
    return rank_slice(tokens, rank, world), rank_slice(targets, rank, world)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def _pieces(model: nn.Module) -> dict:
    """``grad_pieces`` that also takes unmanaged (ignored) parameters: their
    whole gradient, as a piece at offset 0 (the same on every rank)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            info = param_info(p)
            out[name] = ((0, tuple(p.shape)) if info is None else
                         (info.local_offset, tuple(info.shape))) + (p.grad.detach().clone(),)
    return out


# ============================================================================
# both entry points against torch on one process
# ============================================================================
def norms_worker(foreach: bool) -> dict:
    rank, world = rank_world()
    model = _annotate(_model())
    model.loss(*_batch(0)).backward()
    ignored = model.blocks[0].fc2.bias.grad  # not reduced by fully_shard: average as a user would
    dist.all_reduce(ignored)
    ignored.div_(world)
    params = list(model.parameters())
    saved = [None if p.grad is None else p.grad.clone() for p in params]

    def restore():
        for p, g in zip(params, saved):
            if g is not None:
                p.grad.copy_(g)

    out = {"empty": sorted(n for n, p in model.named_parameters()
                           if p.grad is not None and p.grad.numel() == 0),
           "frozen_grads": [n for n, p in model.named_parameters()
                            if n in FROZEN and p.grad is not None],
           "total": {}, "clip": {}, "clipped": {}, "counts": {}}
    for norm_type in NORM_TYPES:
        with CollectiveCounter() as counter:
            out["total"][norm_type] = torch.nn.utils.get_total_norm(
                _grads(model), norm_type, foreach=foreach)
        out["counts"][("total", norm_type)] = {str(k): v for k, v in counter.counts.items()}
        with CollectiveCounter() as counter:
            out["clip"][norm_type] = torch.nn.utils.clip_grad_norm_(
                model.parameters(), MAX_NORM, norm_type, foreach=foreach)
        out["counts"][("clip", norm_type)] = {str(k): v for k, v in counter.counts.items()}
        out["clipped"][norm_type] = _pieces(model)
        restore()
    # references taken before any fully_shard (module import) are routed too
    out["early_total"] = early_get_total_norm(_grads(model), foreach=foreach)
    out["early_clip"] = early_clip_grad_norm_(params, MAX_NORM, foreach=foreach)
    restore()
    out["weights"] = torch.nn.utils.get_total_norm(model.parameters(), foreach=foreach)
    # turned off: torch's own code sees this rank's shards only
    route_torch_grad_norms(False)
    try:
        out["local_total"] = torch.nn.utils.get_total_norm(_grads(model), foreach=foreach)
    finally:
        route_torch_grad_norms(True)
    # a model fully_shard does not manage: torch's code, bit for bit
    plain = nn.Linear(7, 5)
    plain(torch.randn(3, 7)).square().sum().backward()
    plain_grads = [p.grad for p in plain.parameters()]
    with torch.no_grad():
        torch_own = torch.nn.utils.clip_grad._get_total_norm.__wrapped__(plain_grads, 2.0)
    out["plain_equal"] = torch.equal(torch.nn.utils.get_total_norm(plain_grads), torch_own)
    return out


def reference_norms(world: int) -> dict:
    model = _model()
    tokens, targets = token_batch(0, world * PER_RANK, seed=DATA_SEED)
    model.loss(tokens, targets).backward()
    params = dict(model.named_parameters())
    saved = {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}
    ref = {"total": {}, "clip": {}, "clipped": {}}
    for norm_type in NORM_TYPES:
        ref["total"][norm_type] = torch.nn.utils.get_total_norm(_grads(model), norm_type)
        ref["clip"][norm_type] = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM,
                                                                norm_type)
        ref["clipped"][norm_type] = {n: p.grad.clone() for n, p in params.items()
                                     if p.grad is not None}
        for n, p in params.items():
            if saved[n] is not None:
                p.grad.copy_(saved[n])
    ref["weights"] = torch.nn.utils.get_total_norm(model.parameters())
    return ref


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-5, atol=1e-7,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for-loop"])
def test_torch_norm_functions_give_the_global_norm(foreach):
    results = run_distributed(WORLD, norms_worker, foreach, timeout=TIMEOUT)
    ref = reference_norms(WORLD)
    assert any(r["empty"] for r in results), "some rank must own nothing of some parameter"
    for rank, res in enumerate(results):
        assert res["frozen_grads"] == []
        for norm_type in NORM_TYPES:
            for entry in ("total", "clip"):
                assert torch.equal(res[entry][norm_type], results[0][entry][norm_type]), rank
                _close(res[entry][norm_type], ref[entry][norm_type],
                       f"rank {rank}: {entry} {norm_type}-norm")
                assert res["counts"][(entry, norm_type)] == {str(ALL_REDUCE): 1}, (entry, norm_type)
        _close(res["early_total"], ref["total"][2.0], f"rank {rank}: early get_total_norm")
        _close(res["early_clip"], ref["clip"][2.0], f"rank {rank}: early clip_grad_norm_")
        _close(res["weights"], ref["weights"], f"rank {rank}: weight norm")
        assert res["plain_equal"]
    for norm_type in NORM_TYPES:
        got = assemble_grads([r["clipped"][norm_type] for r in results])
        assert_dicts_close(got, ref["clipped"][norm_type], 1e-6, f"{norm_type}-clipped grad of ")
    # what the routing prevents: every rank's own, wrong, norm
    local = [r["local_total"].item() for r in results]
    assert len(set(local)) == WORLD and all(n < ref["total"][2.0].item() for n in local)


# ============================================================================
# training clipped by torch's function, SGD-momentum and AdamW
# ============================================================================
def train_clipped(optim_name: str, steps: int = 3) -> dict:
    model = _annotate(_model())
    optim = make_optim([p for p in model.parameters() if p.requires_grad], optim_name)
    losses, norms = [], []
    for step in range(steps):
        loss = model.loss(*_batch(step))
        loss.backward()
        bias = model.blocks[0].fc2.bias.grad
        dist.all_reduce(bias)
        bias.div_(dist.get_world_size())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss))
    with torch.no_grad():
        from fsdp_compose import full_params
        with full_params(model, writeback=False):
            params = plain_params(model)
    return {"losses": losses, "norms": norms, "params": params}


def reference_train_clipped(world: int, optim_name: str, steps: int = 3) -> dict:
    model = _model()
    optim = make_optim([p for p in model.parameters() if p.requires_grad], optim_name)
    losses, norms = [], []
    for step in range(steps):
        loss = model.loss(*token_batch(step, world * PER_RANK, seed=DATA_SEED))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": plain_params(model)}


@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_training_clipped_by_torch_matches_one_process(optim_name):
    results = run_distributed(WORLD, train_clipped, optim_name, timeout=TIMEOUT)
    ref = reference_train_clipped(WORLD, optim_name)
    assert all(n > CLIP for n in ref["norms"])  # clipping bites every step
    for rank, res in enumerate(results):
        for key in ("losses", "norms"):
            for step, (got, want) in enumerate(zip(res[key], ref[key])):
                assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), \
                    f"rank {rank}, step {step}: {key} {got} vs {want}"
        assert_dicts_close(res["params"], ref["params"], 1e-5, f"rank {rank}: ")


# ============================================================================
# managed gradients recognised by identity, not shape
# ============================================================================
class _BiasFree(nn.Module):
    """Only 2-D parameters: under shape-keeping placements no managed
    gradient is 1-D between iterations."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(7, 15, bias=False), nn.Tanh(),
                                    nn.Linear(15, 9, bias=False), nn.Tanh(),
                                    nn.Linear(9, 3, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _shard1(p: torch.Tensor):
    return Shard(1)


_NORM_PLACEMENTS = {"flat": ("flat", None), "rows": ("rows", None), "blocks2": (Blocks(2), None),
                    "shard1": ("flat", _shard1), "owned": ("owned", None)}


def _bias_free_norms(placement: Optional[str]) -> dict:
    """Every norm entry point after one backward on this rank's rows of a
    global batch (``placement`` None: one process on the whole batch)."""
    torch.manual_seed(0)
    model = _BiasFree()
    x = torch.randn(12, 7, generator=torch.Generator().manual_seed(1))
    if placement is not None:
        rank, world = rank_world()
        unit_placement, placement_fn = _NORM_PLACEMENTS[placement]
        for layer in model.layers[::2]:
            fully_shard(layer, placement=unit_placement, shard_placement_fn=placement_fn)
        fully_shard(model, placement=unit_placement)
        x = rank_slice(x, rank, world)
    model(x).square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    per_param = fsdp_compose.param_norms(model.parameters())
    out = {"get_total_norm": torch.nn.utils.get_total_norm(grads),
           "get_total_norm_for_loop": torch.nn.utils.get_total_norm(grads, foreach=False),
           "param_norms": torch.linalg.vector_norm(torch.stack(per_param))}
    saved = [(p.grad, p.grad.clone()) for p in model.parameters() if p.grad is not None]
    for name, clip in (("torch_clip", torch.nn.utils.clip_grad_norm_),
                       ("our_clip", fsdp_compose.clip_grad_norm_)):
        out[name] = clip(model.parameters(), 1e-3)
        for grad, value in saved:
            grad.copy_(value)
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("placement", list(_NORM_PLACEMENTS))
def test_every_norm_entry_point_is_global_whatever_the_shapes(placement, world):
    """Only 2-D managed gradients: ``get_total_norm`` used to route by
    shape (some 1-D tensor) and returned each rank's local norm under
    ``"rows"``. At 3 ranks some rank holds no row of some matrices (an
    empty ``.grad`` there, so every rank lists the same gradients), and
    under ``"owned"`` a rank may hold no matrix at all (``.grad`` is
    ``None``): torch's ``clip_grad_norm_`` and ours route by parameter and
    stay global."""
    want = _bias_free_norms(None)["get_total_norm"]
    for rank, got in enumerate(run_distributed(world, _bias_free_norms, placement,
                                               timeout=TIMEOUT)):
        for name, value in got.items():
            _close(value, want, f"rank {rank} {placement} {name}")
