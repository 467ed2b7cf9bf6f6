"""How gradients reach the optimizer and what conversions keep working, each
held to a single-process reference on the global batch where numbers matter.

Numbering follows the issue ("What real code does"): 4 unused parameters
get ``.grad is None``, 5 no-sync accumulation under mixed precision in fp32,
6 post-accumulate-grad hooks on the original parameters, 7 ``module.to(dtype)``
after ``fully_shard`` (and ``to_empty`` of a sibling-list unit), 8 mixed precision casts dataclass inputs, 9 containers.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_compose import MixedPrecisionPolicy, fully_shard, param_info
from tests._models import (D, HIDDEN, OUT, PER_RANK, SEED,
                           assert_parity, build_features, build_lm, feature_batch, full_params,
                           global_mean, lm_loss, make_optim, plain_params, rank_slice, rank_world,
                           shard_blocks_and_root, token_batch)
from tests.harness import run_distributed

TIMEOUT = 60
OPTIMS = ["sgd", "adamw"]


# ============================================================================
# 4. Unused parameters get .grad None; used ones always get a (maybe empty) grad
# ============================================================================
class SparseBlock(nn.Module):
    """``unused`` is never read; ``extra`` only for samples whose first
    feature is positive (and only if there is one); ``out.bias`` has 2
    elements and comes last in the unit, so on 3 ranks some own none of it."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.randn(5))
        self.extra = nn.Parameter(torch.randn(HIDDEN))
        self.fc = nn.Linear(D, HIDDEN)
        self.out = nn.Linear(HIDDEN, 2)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        mask = x[:, 0] > 0
        if bool(mask.any()):
            h = h + mask[:, None].to(h.dtype) * self.extra
        return self.out(h)


class SparseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = SparseBlock()
        self.head = nn.Linear(2, OUT)

    def forward(self, x):
        return self.head(self.block(x))


def _sparse_batch(step: int, world: int, layout: str):
    """``all``: every sample uses ``extra``; ``rank0-only``: only some of rank
    0's samples do (so the global batch does, rank 1's slice does not)."""
    x, y = feature_batch(step, world * PER_RANK, seed=4)
    first = x[:, 0].abs() + 0.1
    if layout == "rank0-only":
        sign = -torch.ones(world * PER_RANK)
        sign[:PER_RANK // 2] = 1.0  # the first half of rank 0's slice
        first = first * sign
    x[:, 0] = first
    return x, y


def train_sparse(layout: str, optim_name: str, steps: int, world: int = 0):
    sharded = world == 0
    rank, world = rank_world() if sharded else (0, world)
    torch.manual_seed(SEED)
    model = SparseNet()
    if sharded:
        fully_shard(model.block)
        fully_shard(model)
    optim = make_optim(model.parameters(), optim_name)
    grads, losses = [], []
    for step in range(steps):
        x, y = _sparse_batch(step, world, layout)
        if sharded:
            x, y = rank_slice(x, rank, world), rank_slice(y, rank, world)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        grads.append({n: None if p.grad is None else p.grad.numel()
                      for n, p in model.named_parameters()})
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss) if sharded else loss.item())
    local = {n: param_info(p).local_numel if sharded else p.numel()
             for n, p in model.named_parameters()}
    return {"losses": losses, "params": full_params(model) if sharded else plain_params(model),
            "grads": grads, "local_numel": local}


def test_unused_parameter_has_no_grad_and_is_not_decayed():
    """Static case on 3 ranks with AdamW(weight_decay=0.1): ``block.unused``
    keeps ``.grad is None`` (so AdamW leaves it alone, as in one process);
    every used parameter has a gradient on every rank, an empty tensor where
    the rank owns none of it."""
    results = run_distributed(3, train_sparse, "all", "adamw", 3, timeout=TIMEOUT)
    reference = train_sparse("all", "adamw", 3, world=3)
    assert_parity(results, reference)
    owners_of_nothing = [r for r, res in enumerate(results)
                         if res["local_numel"]["block.out.bias"] == 0]
    assert owners_of_nothing, "test setup: some rank should own no element of block.out.bias"
    for rank, res in enumerate(results):
        for step, grads in enumerate(res["grads"]):
            assert grads["block.unused"] is None, (
                f"rank {rank}, step {step}: the never-used block.unused has a .grad")
            for name, numel in grads.items():
                if name == "block.unused":
                    continue
                assert numel is not None, f"rank {rank}, step {step}: used {name} has .grad None"
                assert numel == res["local_numel"][name], (name, numel, res["local_numel"][name])
        if rank in owners_of_nothing:
            assert all(g["block.out.bias"] == 0 for g in res["grads"])  # empty, not None


def test_parameter_used_on_one_rank_only_gets_grad_everywhere():
    """Data-dependent use: ``block.extra`` is used by rank 0's samples only
    (the global batch uses it). Every rank has a ``.grad`` for it (empty
    where it owns none), parity with AdamW; ``block.unused`` has none."""
    results = run_distributed(2, train_sparse, "rank0-only", "adamw", 3, timeout=TIMEOUT)
    reference = train_sparse("rank0-only", "adamw", 3, world=2)
    for grads in reference["grads"]:
        assert grads["block.extra"] is not None and grads["block.unused"] is None  # setup
    for rank, res in enumerate(results):
        for step, grads in enumerate(res["grads"]):
            assert grads["block.extra"] is not None, (
                f"rank {rank}, step {step}: block.extra, used by rank 0's input, has .grad None")
            assert grads["block.extra"] == res["local_numel"]["block.extra"]
            assert grads["block.unused"] is None, (
                f"rank {rank}, step {step}: the never-used block.unused has a .grad")
    assert_parity(results, reference)


# ============================================================================
# 5. No-sync accumulation under mixed precision accumulates in fp32
# ============================================================================
def accumulation_precision_gap(micro: int = 4):
    """Runs on every rank. Two copies of one bf16-compute model: one
    accumulates ``micro`` micro-batches without sync (reducing on the last),
    one syncs every micro-batch (accumulating fp32 reduced shards). Returns
    max |difference of the sharded grads| / max |grad|."""
    rank, world = rank_world()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  output_dtype=torch.float32)
    tokens, targets = token_batch(0, world * PER_RANK * micro, seed=5)
    tokens, targets = rank_slice(tokens, rank, world), rank_slice(targets, rank, world)
    grads = {}
    for mode in ("nosync", "sync"):
        model = build_lm()
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model)
        for i, (x, y) in enumerate(zip(tokens.chunk(micro), targets.chunk(micro))):
            if mode == "nosync":
                model.set_requires_gradient_sync(i == micro - 1)
            (model.loss(x, y) / micro).backward()
        grads[mode] = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                       if n.startswith("blocks.") and p.grad is not None and p.numel()}
    diff = max((grads["nosync"][n] - grads["sync"][n]).abs().max().item() for n in grads["sync"])
    scale = max(g.abs().max().item() for g in grads["sync"].values())
    return diff / scale


def test_nosync_accumulation_under_bf16_accumulates_in_fp32():
    # Measured: fp32 accumulation differs from sync accumulation by ~1e-7 of
    # the largest gradient (summation order); bf16 accumulation by ~1e-3.
    for rank, ratio in enumerate(run_distributed(2, accumulation_precision_gap, timeout=TIMEOUT)):
        assert ratio <= 1e-5, (
            f"rank {rank}: no-sync accumulation differs from sync accumulation by {ratio:.3g} "
            "of the largest gradient (bf16 accumulation?)")


# ============================================================================
# 6. register_post_accumulate_grad_hook on original parameters
# ============================================================================
def train_optimizer_in_backward(steps: int):
    rank, world = rank_world()
    model = build_lm()
    shard_blocks_and_root(model)
    calls = {n: [] for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        optim = torch.optim.SGD([p], lr=0.05, momentum=0.9)

        def hook(param, name=name, optim=optim):
            grad = param.grad
            info = param_info(param)
            calls[name].append(None if grad is None else
                               (tuple(grad.shape), tuple(param.shape), grad.numel(),
                                info.local_numel, len(info.shape)))
            optim.step()
            optim.zero_grad()
        p.register_post_accumulate_grad_hook(hook)
    per_step = []
    for step in range(steps):
        tokens, targets = token_batch(step, world * PER_RANK, seed=6)
        model.loss(rank_slice(tokens, rank, world), rank_slice(targets, rank, world)).backward()
        per_step.append({n: len(c) for n, c in calls.items()})
    return {"params": full_params(model), "calls": calls, "per_step": per_step}


def reference_plain(world: int, optim_name: str, steps: int, seed: int):
    model = build_lm()
    optim = make_optim(model.parameters(), optim_name)
    for step in range(steps):
        tokens, targets = token_batch(step, world * PER_RANK, seed=seed)
        model.loss(tokens, targets).backward()
        optim.step()
        optim.zero_grad()
    return {"params": plain_params(model)}


def test_post_accumulate_grad_hook_optimizer_in_backward_parity():
    steps = 3
    results = run_distributed(2, train_optimizer_in_backward, steps, timeout=TIMEOUT)
    for rank, res in enumerate(results):
        for step, counts in enumerate(res["per_step"]):
            for name, count in counts.items():
                assert count == step + 1, (
                    f"rank {rank}: the hook of {name} fired {count} times in {step + 1} backwards")
        for name, calls in res["calls"].items():
            for call in calls:
                assert call is not None, f"rank {rank}: {name}'s hook saw .grad None"
                shape, param_shape, numel, local, full_ndim = call
                # the sharded gradient, in the parameter's local shape: (rows_here, *rest)
                # under the default placement, so the original ndim
                assert shape == param_shape and len(shape) == full_ndim and numel == local, (
                    f"rank {rank}: {name}'s hook saw a gradient of shape {shape} "
                    f"({numel} elements); expected the sharded gradient of {local} elements "
                    f"in the parameter's local shape {param_shape}, ndim {full_ndim}")
    assert_parity(results, reference_plain(2, "sgd", steps, seed=6))


# ============================================================================
# 6b. A .grad the user assigns after zero_grad(set_to_none=True) is added to
# ============================================================================
def train_with_assigned_grads(optim_name: str, steps: int, world: int = 0):
    """Every other step, after the gradients were cleared, the user gives
    every other parameter a ``.grad`` of its own before backward (a constant,
    so a shard's is the slice of the whole one): backward adds to it, as in
    one process. The published gradient is dead by then, so the reduction
    leaves the reading of ``.grad`` to publication ([Note: reading .grad at
    publication] in ``buffers/flat_grad.py``)."""
    sharded = world == 0
    rank, world = rank_world() if sharded else (0, world)
    model = build_lm()
    if sharded:
        shard_blocks_and_root(model)
    optim = make_optim(model.parameters(), optim_name)
    for step in range(steps):
        if step % 2 == 1:
            for index, param in enumerate(model.parameters()):
                if index % 2 == 0:
                    param.grad = torch.full_like(param, 0.05 * (index + 1))
        tokens, targets = token_batch(step, world * PER_RANK, seed=8)
        if sharded:
            tokens, targets = rank_slice(tokens, rank, world), rank_slice(targets, rank, world)
        model.loss(tokens, targets).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    return {"params": full_params(model) if sharded else plain_params(model)}


@pytest.mark.parametrize("optim_name", OPTIMS)
def test_a_grad_assigned_after_clearing_is_accumulated_into(optim_name):
    results = run_distributed(3, train_with_assigned_grads, optim_name, 4, timeout=TIMEOUT)
    assert_parity(results, train_with_assigned_grads(optim_name, 4, world=3))


# ============================================================================
# 7. module.to(dtype) after fully_shard
# ============================================================================
def train_converted(dtype_name: str, swap: bool, steps: int, world: int = 0):
    dtype = getattr(torch, dtype_name)
    sharded = world == 0
    rank, world = rank_world() if sharded else (0, world)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        model = build_features()
        before = dict(model.named_parameters())
        if sharded:
            shard_blocks_and_root(model)
        model.to(dtype)
        after = dict(model.named_parameters())
        same_objects = list(after) == list(before) and all(after[n] is before[n] for n in before)
        dtypes = {str(p.dtype) for p in model.parameters()}
        optim = make_optim(model.parameters(), "adamw")
        losses = []
        for step in range(steps):
            x, y = feature_batch(step, world * PER_RANK, seed=7)
            if sharded:
                x, y = rank_slice(x, rank, world), rank_slice(y, rank, world)
            loss = F.mse_loss(model(x.to(dtype)), y.to(dtype))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(global_mean(loss) if sharded else loss.item())
        params = full_params(model) if sharded else plain_params(model)
        return {"losses": losses, "params": params, "same_objects": same_objects,
                "dtypes": dtypes, "final_dtypes": {str(p.dtype) for p in model.parameters()}}
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


@pytest.mark.parametrize("swap", [False, True], ids=["assign-data", "swap-tensors"])
def test_to_float64_after_fully_shard_trains_with_parity(swap):
    """7(a), 7(b)"""
    results = run_distributed(2, train_converted, "float64", swap, 2, timeout=TIMEOUT)
    reference = train_converted("float64", swap, 2, world=2)
    for rank, res in enumerate(results):
        assert res["same_objects"], f"rank {rank}: model.double() replaced parameter objects"
        assert res["dtypes"] == {"torch.float64"} == res["final_dtypes"], res["dtypes"]
        for name, value in res["params"].items():
            assert value.dtype == torch.float64, (name, value.dtype)
    assert_parity(results, reference, atol=1e-9)


def forward_in_bf16_after_to():
    rank, world = rank_world()
    model = build_lm()
    before = dict(model.named_parameters())
    shard_blocks_and_root(model)
    model.to(torch.bfloat16)
    after = dict(model.named_parameters())  # read before forward: the root stays unsharded after it
    param_dtypes = {str(p.dtype) for p in model.parameters()}
    tokens, targets = token_batch(0, world * PER_RANK, seed=8)
    logits = model(rank_slice(tokens, rank, world))
    loss = lm_loss(logits, rank_slice(targets, rank, world))
    return {"param_dtypes": param_dtypes, "logits_dtype": str(logits.dtype), "loss": loss.item(),
            "same_objects": list(after) == list(before)
            and all(after[n] is before[n] for n in before)}


def test_to_bfloat16_after_fully_shard_forward_works():
    """7(c)"""
    for rank, res in enumerate(run_distributed(2, forward_in_bf16_after_to, timeout=TIMEOUT)):
        assert res["param_dtypes"] == {"torch.bfloat16"}, res["param_dtypes"]
        assert res["logits_dtype"] == "torch.bfloat16"
        assert torch.isfinite(torch.tensor(res["loss"])), res["loss"]
        assert res["same_objects"], (
            f"rank {rank}: model.to(torch.bfloat16) replaced parameter objects")


def convert_sibling_list_unit(meta: bool):
    """fully_shard([a, b]) under an annotated root, then the root's
    ``.double()`` or ``materialize`` (``to_empty``): the root's conversion
    recurses into a's ``_apply`` while b is still unconverted."""
    from fsdp_compose import materialize
    torch.manual_seed(SEED)
    with torch.device("meta") if meta else torch.device("cpu"):
        model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 3), nn.Linear(3, 1))
    fully_shard([model[0], model[1]])
    fully_shard(model)
    if meta:
        torch.manual_seed(SEED)
        materialize(model)
    else:
        model.double()
    return {n: v.full_tensor() for n, v in model.state_dict().items()}


@pytest.mark.parametrize("meta", [False, True], ids=["double", "materialize"])
def test_conversions_of_a_sibling_list_unit(meta):
    """7(d): found by tests/core/test_fuzz_parity.py (a sibling list on the meta device)"""
    torch.manual_seed(SEED)
    eager = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 3), nn.Linear(3, 1))
    want = {n: (v if meta else v.double()) for n, v in eager.state_dict().items()}
    for full in run_distributed(2, convert_sibling_list_unit, meta, timeout=TIMEOUT):
        for name, value in want.items():
            assert full[name].dtype == value.dtype and torch.equal(full[name], value), name


# ============================================================================
# 8. Mixed precision casts dataclass inputs
# ============================================================================
@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    mask: torch.Tensor


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    x: torch.Tensor
    mask: torch.Tensor


class BatchConsumer(nn.Module):
    """Records the dtypes of the batch it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, HIDDEN)
        self.seen: list = []

    def forward(self, batch):
        inner = batch["inner"] if isinstance(batch, dict) else batch
        self.seen.append((str(inner.x.dtype), str(inner.mask.dtype)))
        out = self.fc(inner.x.to(self.fc.weight.dtype))
        return out * inner.mask[:, None].to(out.dtype)


def dataclass_input_dtypes():
    rank, world = rank_world()
    torch.manual_seed(SEED)
    model = BatchConsumer()
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    x, _ = feature_batch(0, PER_RANK, seed=9)
    mask = x[:, 1] > 0
    batches = {"dataclass": Batch(x, mask), "frozen-dataclass": FrozenBatch(x, mask),
               "dataclass-in-dict": {"inner": Batch(x, mask)}}
    seen = {}
    for kind, batch in batches.items():
        model.seen.clear()
        model(batch).float().sum().backward()
        seen[kind] = model.seen[0]
    caller_x = str(batches["dataclass"].x.dtype)
    return {"seen": seen, "caller_x": caller_x}


def test_mixed_precision_casts_dataclass_inputs():
    for rank, res in enumerate(run_distributed(2, dataclass_input_dtypes, timeout=TIMEOUT)):
        for kind, (x_dtype, mask_dtype) in res["seen"].items():
            assert x_dtype == "torch.bfloat16", (
                f"rank {rank}: {kind}: forward saw batch.x as {x_dtype}, not param_dtype bf16")
            assert mask_dtype == "torch.bool", (
                f"rank {rank}: {kind}: the bool mask became {mask_dtype}")
        assert res["caller_x"] == "torch.float32", "the caller's dataclass was modified in place"


# ============================================================================
# 9. Containers
# ============================================================================
def annotate_container(kind: str):
    torch.manual_seed(SEED)
    if kind == "ModuleList":
        container = nn.ModuleList([nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)])
    else:
        container = nn.ModuleDict({"a": nn.Linear(D, HIDDEN), "b": nn.Linear(HIDDEN, D)})
    try:
        fully_shard(container)
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("kind", ["ModuleList", "ModuleDict"])
def test_annotating_a_container_without_forward_raises(kind):
    """9(a)"""
    for rank, res in enumerate(run_distributed(2, annotate_container, kind, timeout=TIMEOUT)):
        assert res is not None, f"rank {rank}: fully_shard({kind}(...)) did not raise"
        _, message = res
        assert re.search(r"child|as a list|list of", message, re.IGNORECASE), message


def slice_sequential():
    torch.manual_seed(SEED)
    seq = nn.Sequential(nn.Linear(D, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, D))
    children = list(seq)
    fully_shard(seq[0])
    fully_shard(seq[2])
    fully_shard(seq)
    head = seq[:2]
    return {"type_is_sequential": type(head) is nn.Sequential, "type": type(head).__name__,
            "same_children": len(head) == 2 and all(a is b for a, b in zip(head, children[:2]))}


def test_slicing_an_annotated_sequential_gives_a_plain_sequential():
    """9(b)"""
    for res in run_distributed(2, slice_sequential, timeout=TIMEOUT):
        assert res["type_is_sequential"], f"type(seq[:2]) is {res['type']}, not nn.Sequential"
        assert res["same_children"]
