"""Backward finalized by the caller (FSDP2 2.15's
``set_manual_backward_finalization`` / ``finalize_backward``, synchronous
and asynchronous), the replica all-reduce deferred to an asynchronous
finalization under hybrid sharding, the pending-gradient view
(``get_pending_gradients`` / ``synchronize_gradients``), and kept
unsharded storage (``set_keep_unsharded_storage``).

Run: ``PYTHONPATH=. python -m pytest -q tests/core/test_manual_finalization.py``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import GradientReductionHandle, describe, estimate_memory, fully_shard, param_info
from fsdp_compose.runtime.state import state_of, states_below
from fsdp_compose.testing import synthetic_tokens
from tests._comm_counter import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from tests._models import assemble_grads, grad_pieces
from tests._training import CFG, build_model
from tests.harness import run_distributed
from tests.core.test_fsdp2_methods import GroupNames
from tests.parallelism.test_hsdp import unsharded_params

MICRO = 3
STEPS = 3


def _batch(step: int, world: int):
    return synthetic_tokens(step, world * MICRO, CFG.seq_len, CFG.vocab_size, seed=5)


def _optim(params, name: str):
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _reference(world: int, optim_name: str) -> dict:
    """One process on the global batch (each micro-batch's loss / MICRO)."""
    model = build_model()
    optim = _optim(model.parameters(), optim_name)
    for step in range(STEPS):
        x, y = _batch(step, world)
        model.loss(x, y).backward()
        optim.step()
        optim.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _shard(mesh_shape):
    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = build_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, mesh


def _micro_batches(step: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _batch(step, world)
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    return list(zip(x[mine].chunk(MICRO), y[mine].chunk(MICRO)))


def _train_manual(mesh_shape, mode: str, optim_name: str) -> dict:
    """Every rank: manual finalization; ``mode``: ``sync`` (reduce every
    micro-batch, finalize synchronously), ``no-sync`` (only the last
    micro-batch reduces, as FSDP2 advises), ``async`` (handle),
    ``hsdp-deferred`` (no replica all-reduce in any micro-batch; the
    asynchronous finalization runs it). Records that no ``.grad`` is
    published before finalization and the collectives of the last step."""
    model, mesh = _shard(mesh_shape)
    model.set_manual_backward_finalization(True)
    optim = _optim(model.parameters(), optim_name)
    out: dict = {"unpublished_before_finalize": True}
    for step in range(STEPS):
        counter = GroupNames()
        with counter if step == STEPS - 1 else contextlib.nullcontext():
            for i, (a, b) in enumerate(_micro_batches(step)):
                last = i == MICRO - 1
                if mode == "no-sync":
                    model.set_requires_gradient_sync(last)
                if mode == "hsdp-deferred":
                    model.set_requires_all_reduce(False)
                (model.loss(a, b) / MICRO).backward()
            out["unpublished_before_finalize"] &= all(
                p.grad is None for p in model.parameters())
            backward_counts = dict(counter.by_name)
            if mode in ("async", "hsdp-deferred"):
                handle = model.finalize_backward(async_op=True)
                assert isinstance(handle, GradientReductionHandle)
                torch.randn(64, 64) @ torch.randn(64, 64)  # work that does not touch the gradients
                handle.wait()
                handle.wait()  # a second wait does nothing
            else:
                assert model.finalize_backward() is None
        if step == STEPS - 1:
            replicate = mesh["replicate"].get_group().group_name if len(mesh_shape) == 2 else None
            shard = mesh["shard"].get_group().group_name
            out["replica_all_reduce_in_backward"] = backward_counts.get((ALL_REDUCE, replicate), 0)
            out["replica_all_reduce"] = counter.by_name[ALL_REDUCE, replicate]
            out["reduce_scatter"] = counter.by_name[REDUCE_SCATTER, shard]
            out["all_gather"] = counter.by_name[ALL_GATHER, shard]
            out["trainable_buffers"] = sum(
                1 for m in [*model.blocks, model] for _ in _trainable_buffers(m))
        optim.step()
        optim.zero_grad()
    out["params"] = unsharded_params(model)
    return out


def _trainable_buffers(module):
    return state_of(module).unit.trainable_buffers


def _atol(optim_name: str) -> float:
    """AdamW's normalised update turns the rounding of a sum over three
    micro-batches instead of one batch into ~2e-5 on tiny gradient
    elements; a missing or doubled gradient moves parameters by ~1e-2."""
    return 1e-4 if optim_name == "adamw" else 1e-5


def _assert_params(results, reference, atol=1e-5):
    for rank, res in enumerate(results):
        for name, want in reference.items():
            diff = (res["params"][name] - want).abs().max().item()
            assert diff <= atol, f"rank {rank}: {name} differs by {diff}"


@pytest.mark.parametrize("mode,optim_name", [("sync", "sgd"), ("no-sync", "adamw"),
                                             ("async", "sgd"), ("async", "adamw")])
def test_manual_finalization_trains_like_one_process(mode, optim_name):
    """3 ranks, 3 micro-batches a step, finalized by the caller (at once or
    through the handle): nothing is published before ``finalize_backward``
    and the parameters match one process on the global batch."""
    results = run_distributed(3, _train_manual, (3,), mode, optim_name, timeout=240)
    for res in results:
        assert res["unpublished_before_finalize"]
    _assert_params(results, _reference(3, optim_name), _atol(optim_name))


@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_hsdp_replica_all_reduce_deferred_to_async_finalization(optim_name):
    """(2, 2) mesh, no replica all-reduce in any micro-batch: the
    asynchronous finalization issues one per trainable buffer for the step
    (none during the backwards), every micro-batch reduce-scatters in the
    shard group, and training matches one process."""
    results = run_distributed(4, _train_manual, (2, 2), "hsdp-deferred", optim_name, timeout=300)
    for res in results:
        assert res["replica_all_reduce_in_backward"] == 0
        # one per trainable buffer, plus the publication's all-reduce of the used flags
        assert res["replica_all_reduce"] == res["trainable_buffers"] + 1 > 1
        assert res["reduce_scatter"] % MICRO == 0 and res["reduce_scatter"] > 0  # every micro-batch
        assert res["unpublished_before_finalize"]
    _assert_params(results, _reference(4, optim_name), _atol(optim_name))


# ----------------------------------------------------------------- misuse
def _misuse() -> dict:
    model, _ = _shard((dist.get_world_size(),))
    out = {}
    out["before_forward"] = (model.finalize_backward(), type(model.finalize_backward(async_op=True)))
    try:
        model.blocks[0].set_manual_backward_finalization(True)
    except RuntimeError as e:
        out["not_root_before_forward"] = str(e)
    a, b = _micro_batches(0)[0]
    model.loss(a, b).backward()
    try:
        model.finalize_backward()
    except RuntimeError as e:
        out["not_manual"] = str(e)
    try:
        model.blocks[0].finalize_backward()
    except RuntimeError as e:
        out["not_root"] = str(e)
    model.set_manual_backward_finalization(True)
    loss = model.loss(a, b)

    def during_backward(grad):
        try:
            model.set_manual_backward_finalization(False)
        except RuntimeError as e:
            out["during_backward"] = str(e)
        return grad
    loss.register_hook(during_backward)
    loss.backward()
    try:
        model.set_manual_backward_finalization(False)
    except RuntimeError as e:
        out["after_backward_started"] = str(e)
    handle = model.finalize_backward(async_op=True)
    try:
        model.finalize_backward()
    except RuntimeError as e:
        out["not_waited"] = str(e)
    handle.wait()
    model.loss(a, b).backward()
    handle = model.finalize_backward(async_op=True)
    model.reset_iter_state()
    try:
        handle.wait()
    except RuntimeError as e:
        out["invalidated"] = str(e)
    return out


def test_manual_finalization_misuse_raises_on_every_rank_with_fsdp2s_rules():
    """FSDP2 2.15's rules, on every rank: a no-op before the first
    forward (``None``, or a handle with ``async_op``); the root only;
    finalizing requires the mode; no mode change during backward nor after
    backward started; an unwaited handle blocks the next finalization; a
    handle ``reset_iter_state`` dropped raises at ``wait()``."""
    for out in run_distributed(2, _misuse, timeout=120):
        assert out["before_forward"] == (None, GradientReductionHandle)
        assert "not the root" in out["not_root_before_forward"]
        assert "set_manual_backward_finalization(True)" in out["not_manual"]
        assert "not the root" in out["not_root"] and "<root>" in out["not_root"]
        assert "during backward" in out["during_backward"]
        assert "finalize_backward() first" in out["after_backward_started"]
        assert "waited on" in out["not_waited"]
        assert "invalidated" in out["invalidated"]


# ------------------------------------------------------- pending gradients
def _pending(mesh_shape, kind: str) -> dict:
    """``kind``: ``unreduced`` (no gradient sync) or ``partial`` (no replica
    all-reduce). Reads the pending gradients (no collective), doubles them,
    synchronizes: the published gradients are twice one process's. Then a
    micro-batch, ``zero_grad`` and another: only the last one counts."""
    model, _ = _shard(mesh_shape)
    reference = build_model()
    a, b = _micro_batches(0)[0]
    if kind == "unreduced":
        model.set_requires_gradient_sync(False)
    else:
        model.set_requires_all_reduce(False)
    model.loss(a, b).backward()
    counter = GroupNames()
    with counter:
        pending = model.get_pending_gradients()
    out: dict = {"collectives_to_read": sum(counter.by_name.values()),
                 "names": sorted(pending), "all": sorted(n for n, _ in model.named_parameters())}
    if kind == "unreduced":  # this rank's own gradient, full shape
        reference.loss(a, b).backward()
        out["unreduced_diff"] = max(
            (pending[n] - p.grad).abs().max().item() for n, p in reference.named_parameters())
        reference.zero_grad()
    for grad in pending.values():
        grad.mul_(2)
    model.synchronize_gradients()
    out["doubled"] = grad_pieces(model)
    model.zero_grad()
    model.loss(a, b).backward()           # dropped by zero_grad below
    model.zero_grad()
    out["after_zero_grad"] = len(model.get_pending_gradients())
    c, d = _micro_batches(1)[0]
    model.loss(c, d).backward()
    model.synchronize_gradients()
    out["fresh"] = grad_pieces(model)
    return out


def _pending_reference(world: int, step: int, scale: float) -> dict:
    model = build_model()
    x, y = _batch(step, world)
    rows = [x[r * MICRO:(r + 1) * MICRO].chunk(MICRO)[0] for r in range(world)]
    targets = [y[r * MICRO:(r + 1) * MICRO].chunk(MICRO)[0] for r in range(world)]
    (model.loss(torch.cat(rows), torch.cat(targets)) * scale).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind,mesh_shape", [("unreduced", (2, 2)), ("partial", (2, 2)),
                                             ("unreduced", (3,))])
def test_pending_gradients_readable_changeable_without_communication(kind, mesh_shape):
    """The pending gradients of every parameter are read without a
    collective (unreduced: this rank's own full-shape gradient); doubled
    in place, ``synchronize_gradients`` publishes twice one process's
    gradient; ``zero_grad`` drops them (only the next micro-batch counts)."""
    world = 1
    for size in mesh_shape:
        world *= size
    results = run_distributed(world, _pending, mesh_shape, kind, timeout=300)
    doubled = _pending_reference(world, 0, 2.0)
    fresh = _pending_reference(world, 1, 1.0)
    for res in results:
        assert res["collectives_to_read"] == 0
        assert res["names"] == res["all"]
        assert res["after_zero_grad"] == 0
        if kind == "unreduced":
            assert res["unreduced_diff"] <= 1e-6
    _assert_full(results, "doubled", doubled)
    _assert_full(results, "fresh", fresh)


def _assert_full(results, key, reference, atol=2e-5):
    assembled = assemble_grads([res[key] for res in results])
    for name, want in reference.items():
        diff = (assembled[name] - want).abs().max().item()
        assert diff <= atol, f"{key}: {name} differs by {diff}"


# ---------------------------------------------------------- kept storage
def _kept_storage(keep: bool) -> dict:
    model, _ = _shard((dist.get_world_size(),))
    if keep:
        model.set_keep_unsharded_storage(True)
    optim = _optim(model.parameters(), "sgd")
    ptrs = []
    for step in range(STEPS):
        for a, b in _micro_batches(step):
            (model.loss(a, b) / MICRO).backward()
            ptrs.append(tuple(_data_ptrs(model)))
        optim.step()
        optim.zero_grad()
    out = {"ptr_sets": len(set(ptrs)),
           "held_between_steps": sum(b.unsharded.untyped_storage().nbytes()
                                     for s in states_below((model,)) for b in s.unit.buffers),
           "sharded_between_steps": not any(b.is_unsharded for s in states_below((model,))
                                            for b in s.unit.buffers)
           and sum(p.numel() for p in model.parameters()) < sum(full for _, full in _sizes(model)),
           "kept_bytes": describe(model).totals.kept_unsharded_bytes}
    plain = build_model()
    out["planned_bytes"] = estimate_memory(plain, dist.get_world_size(),
                                           units=[*plain.blocks, plain],
                                           keep_unsharded_storage=keep).kept_unsharded
    out["params"] = unsharded_params(model)
    return out


def _data_ptrs(model):
    return [b.unsharded.untyped_storage().data_ptr()
            for s in states_below((model,)) for b in s.unit.buffers]


def _sizes(model):
    return [(p, param_info(p).shape.numel()) for p in model.parameters()]


def test_kept_unsharded_storage_keeps_its_data_pointers_and_trains_the_same():
    """3 ranks: with kept storage every unsharded buffer has the same data
    pointer in every micro-batch of every step, its memory is held between
    steps (exactly what ``describe`` counts and the planner plans; none
    without) while the parameters are shards, and training matches one
    process."""
    kept = run_distributed(3, _kept_storage, True, timeout=240)
    freed = run_distributed(3, _kept_storage, False, timeout=240)
    reference = _reference(3, "sgd")
    for k, f in zip(kept, freed):
        assert k["ptr_sets"] == 1
        assert k["held_between_steps"] == k["kept_bytes"] > 0 == f["held_between_steps"]
        assert k["sharded_between_steps"] and f["sharded_between_steps"]
        assert f["kept_bytes"] == f["planned_bytes"] == 0
        assert k["planned_bytes"] == k["kept_bytes"]
    _assert_params(kept, reference)


# ------------------------------------------------- torch FSDP2 (2.15 on)
TORCH_HAS_MANUAL = hasattr(torch_fsdp.FSDPModule, "finalize_backward")


def _train_torch_manual(optim_name: str) -> dict:
    """``_train_manual(..., "no-sync", ...)`` with torch's own
    ``fully_shard`` and its manual finalization (asynchronous)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model()
    for block in model.blocks:
        torch_fsdp.fully_shard(block, mesh=mesh)
    torch_fsdp.fully_shard(model, mesh=mesh)
    before = (model.finalize_backward(), type(model.finalize_backward(async_op=True)).__name__)
    model.set_manual_backward_finalization(True)
    optim = _optim(model.parameters(), optim_name)
    unpublished = True
    for step in range(STEPS):
        for i, (a, b) in enumerate(_micro_batches(step)):
            model.set_requires_gradient_sync(i == MICRO - 1)
            (model.loss(a, b) / MICRO).backward()
        unpublished &= all(p.grad is None for p in model.parameters())
        model.finalize_backward(async_op=True).wait()
        optim.step()
        optim.zero_grad()
    return {"before_forward": before, "unpublished_before_finalize": unpublished,
            "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.skipif(not TORCH_HAS_MANUAL, reason="torch FSDP2 has manual finalization from "
                    "torch 2.15 (make test-newest runs this)")
@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_manual_finalization_matches_torch_fsdp2(optim_name):
    """torch 2.15's FSDP2 and fsdp_compose, manual finalization on the
    same micro-batches (3 ranks): the same parameters and the same no-op
    before the first forward. (FSDP2 may set ``.grad`` before finalization,
    its documentation says to read them after; fsdp_compose publishes none.)"""
    ours = run_distributed(3, _train_manual, (3,), "no-sync", optim_name, timeout=240)
    theirs = run_distributed(3, _train_torch_manual, optim_name, timeout=240)
    for mine, fsdp2 in zip(ours, theirs):
        assert fsdp2["before_forward"][0] is None
        assert mine["unpublished_before_finalize"]  # FSDP2 may show .grad early: "read after"
        for name, want in fsdp2["params"].items():
            diff = (mine["params"][name] - want).abs().max().item()
            assert diff <= _atol(optim_name), f"{name} differs from FSDP2's by {diff}"
