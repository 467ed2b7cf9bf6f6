"""Hybrid sharding over 2-D meshes, pure replication (F = 1) and
``reshard_after_forward=k``: parity with one process on the global batch,
collectives counted per process group, and state dicts in torch FSDP2's
2-D layout."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_compose import fully_shard
from fsdp_compose.runtime.state import state_of
from tests._comm_counter import CollectiveCounter
from tests._training import (CFG, build_model, global_batch, make_optimizer, train_reference,
                             _local)
from tests._checkpointing import resume_through_dcp
from tests.harness import run_distributed


class GroupCounter(CollectiveCounter):
    """Counts c10d ops per (op, size of the process group they ran on)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_group: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.by_group[(func, _group_size(args))] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def _group_size(args) -> int:
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg).size()
            except RuntimeError:
                continue  # a ReduceOp
    raise AssertionError("a c10d op without a process group")


def _mesh(shape: tuple[int, ...]):
    if len(shape) == 1:
        return init_device_mesh("cpu", shape, mesh_dim_names=("shard",))
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _train(mesh_shape, optim_name, steps=3, reshard=None, count_step=None, bucket_cap_mb=None):
    """Every rank: blocks then the root, on ``mesh_shape``; returns the mean
    losses, the full parameters (gathered through the shard group) and
    the collectives of step ``count_step`` per (op, group size)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh(mesh_shape)
    model = build_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)
    if bucket_cap_mb is not None:
        model.set_bucket_cap_mb(bucket_cap_mb)
    optim = make_optimizer(model, optim_name)
    losses, counts = [], None
    for step in range(steps):
        x, y = global_batch(step, world, "plain")
        counter = GroupCounter()
        with counter if step == count_step else _null():
            loss = model.loss(_local(x, rank, world), _local(y, rank, world))
            loss.backward()
        if step == count_step:
            counts = {(str(f).split(".")[1], size): n for (f, size), n in counter.by_group.items()}
        optim.step()
        optim.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    params = unsharded_params(model)
    return {"losses": losses, "params": params, "counts": counts}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def unsharded_params(model) -> dict:
    """Every parameter's whole value (a clone), by name; the model is
    resharded again."""
    model.unshard(recurse=True)
    params = {n: p.detach().clone() for n, p in _named_unsharded(model)}
    model.reshard(recurse=True)
    return params


def _named_unsharded(model):
    for name, _ in list(model.named_parameters()):
        owner, _, attr = name.rpartition(".")
        yield name, getattr(model.get_submodule(owner) if owner else model, attr)


def _assert_parity(results, reference, atol=1e-5):
    for rank, res in enumerate(results):
        for got, want in zip(res["losses"], reference["losses"]):
            assert abs(got - want) <= atol, f"rank {rank}: loss {got} vs {want}"
        for name, want in reference["params"].items():
            diff = (res["params"][name] - want).abs().max().item()
            assert diff <= atol, f"rank {rank}: {name} differs by {diff}"


@functools.cache
def _counted_run(mesh_shape, optim_name, reshard, bucket_cap_mb) -> list[dict]:
    """Three steps on 4 ranks, the collectives of the third (steady) step
    counted: one job serves the parity test and the counting test of the
    same configuration (callers only read the results; every argument
    positional, so that equal calls hit the cache)."""
    return run_distributed(4, _train, mesh_shape, optim_name, reshard=reshard, count_step=2,
                           bucket_cap_mb=bucket_cap_mb, timeout=120)


@functools.cache
def _reference(world: int, optim_name: str) -> dict:
    """``train_reference``, once per configuration (callers only read it)."""
    return train_reference(world, optim_name)


@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
@pytest.mark.parametrize("mesh_shape,reshard", [((2, 2), None), ((4, 1), None), ((4,), 2)],
                         ids=["hsdp-2x2", "replicate-4x1", "reshard-to-2"])
def test_parity_with_one_process(mesh_shape, reshard, optim_name):
    _assert_parity(_counted_run(mesh_shape, optim_name, reshard, None),
                   _reference(4, optim_name))


def test_no_shard_on_two_ranks():
    results = run_distributed(2, _train, (2, 1), "adamw", timeout=90)
    _assert_parity(results, _reference(2, "adamw"))


@pytest.mark.parametrize("bucketed", [False, True])
def test_hsdp_collectives_per_group(bucketed):
    """Per step with the blocks + root on a (2, 2) mesh: all-gathers of the
    blocks in forward and backward plus the root's once, over the shard group
    (size 2); one reduce-scatter per unit there (bucketed, by default: the
    blocks are one bucket, gathered once in forward, each alone in backward
    where it is the first bucket reached, and reduced once); one
    all-reduce per unit across the replicas (size 2) plus the used flags over
    both groups."""
    counts = _counted_run((2, 2), "sgd", None, None if bucketed else 0)
    units = CFG.n_layers + 1
    for c in counts:
        got = c["counts"]
        assert got[("_allgather_base_", 2)] == (2 + CFG.n_layers if bucketed else 2 * units - 1), got
        assert got[("_reduce_scatter_base_", 2)] == (2 if bucketed else units), got
        # gradients across replicas, and the used flags once over each dim
        assert got[("allreduce_", 2)] == units + 2, got
        assert set(got) == {("_allgather_base_", 2), ("_reduce_scatter_base_", 2),
                            ("allreduce_", 2)}, got


def test_replication_collectives():
    """A (4, 1) mesh: nothing to gather or scatter (F = 1); per step one
    all-reduce per unit across the 4 replicas plus the used flags."""
    counts = _counted_run((4, 1), "sgd", None, None)
    for c in counts:
        assert c["counts"] == {("allreduce_", 4): CFG.n_layers + 1 + 1}, c["counts"]


def test_reshard_after_forward_int_gathers_from_the_smaller_group():
    """reshard_after_forward=2 on 4 ranks: the blocks' backward all-gathers
    run over groups of 2 ranks, their forward all-gathers over all 4."""
    counts = _counted_run((4,), "sgd", 2, None)
    for c in counts:
        got = c["counts"]
        blocks = CFG.n_layers
        assert got[("_allgather_base_", 4)] == blocks + 1, got  # blocks and root in forward
        assert got[("_allgather_base_", 2)] == blocks, got  # the blocks again in backward
        assert got[("_reduce_scatter_base_", 4)] == blocks + 1, got


def _bad_int(value):
    model = build_model()
    try:
        fully_shard(model.blocks[0], reshard_after_forward=value)
    except ValueError as e:
        return str(e)
    return None


def test_reshard_after_forward_int_must_divide_the_shard_size():
    messages = run_distributed(4, _bad_int, 3, timeout=60)
    for m in messages:
        assert m is not None and "reshard_after_forward=3" in m and "[1, 2, 4]" in m, m


def _reshard_one_is_false_and_full_is_true():
    model = build_model()
    fully_shard(model.blocks[0], reshard_after_forward=1)
    fully_shard(model.blocks[1], reshard_after_forward=dist.get_world_size())
    fully_shard(model)
    units = [state_of(b).unit for b in model.blocks[:2]]
    return [(u.settings.reshard_after_forward, u.settings.post_forward_group is None) for u in units]


def test_reshard_after_forward_trivial_ints():
    for res in run_distributed(2, _reshard_one_is_false_and_full_is_true, timeout=60):
        assert res == [(False, True), (True, True)]


def _state_dict_round_trip(mesh_shape):
    mesh = _mesh(mesh_shape)
    model = build_model()
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sd = model.state_dict()
    placements = {tuple(v.placements) for v in sd.values() if isinstance(v, DTensor)}
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in sd.items()}
    for name, want in reference.items():
        assert torch.equal(full[name], want), name
    # load a perturbed copy, check it arrives
    perturbed = {k: (v * 2 if isinstance(v, DTensor) else v) for k, v in sd.items()}
    model.load_state_dict(perturbed)
    again = {k: (v.full_tensor() if isinstance(v, DTensor) else v)
             for k, v in model.state_dict().items()}
    for name, want in reference.items():
        assert torch.equal(again[name], want * 2), name
    return sorted(str(p) for p in placements)


def test_state_dict_on_a_2d_mesh_uses_fsdp2_placements():
    for placements in run_distributed(4, _state_dict_round_trip, (2, 2), timeout=90):
        assert placements == [str((Replicate(), Shard(0)))], placements


def _scatter_full_under_hsdp():
    from fsdp_compose.checkpoint import scatter_full_state_dict
    mesh = _mesh((2, 2))
    reference = build_model()
    torch.manual_seed(99)  # other values: the scatter must overwrite them
    model = type(reference)(CFG)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    src = 1  # not rank 0, so that the replica of the source matters
    scatter_full_state_dict(model, reference.state_dict() if dist.get_rank() == src else None,
                            src=src)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return all(torch.equal(full[n], p) for n, p in reference.state_dict().items())


def test_scatter_full_state_dict_reaches_every_replica():
    assert run_distributed(4, _scatter_full_under_hsdp, timeout=90) == [True] * 4


def _dcp_round_trip(root):
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh((2, 2))

    def build(seed):
        torch.manual_seed(seed)
        model = type(build_model())(CFG)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, make_optimizer(model, "adamw")

    def step(model, optim, i):
        x, y = global_batch(i, world, "plain")
        model.loss(_local(x, rank, world), _local(y, rank, world)).backward()
        optim.step()
        optim.zero_grad()

    model, fresh, osd = resume_through_dcp(build, step, root)
    a = {k: v.full_tensor() for k, v in model.state_dict().items()}
    b = {k: v.full_tensor() for k, v in fresh.state_dict().items()}
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_dcp_round_trip_under_hsdp_continues_identically(tmp_path):
    diffs = run_distributed(4, _dcp_round_trip, str(tmp_path / "ckpt"), timeout=120)
    assert diffs == [0.0] * 4, diffs


def _grad_norm_under_hsdp():
    from fsdp_compose.gradients.clip import clip_grad_norm_
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh((2, 2))
    model = build_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = global_batch(0, world, "plain")
    model.loss(_local(x, rank, world), _local(y, rank, world)).backward()
    return clip_grad_norm_(model, max_norm=1e9).item()


def test_gradient_norm_counts_each_replica_once():
    reference = build_model()
    x, y = global_batch(0, 4, "plain")
    reference.loss(x, y).backward()
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9).item()
    for got in run_distributed(4, _grad_norm_under_hsdp, timeout=60):
        assert got == pytest.approx(want, rel=1e-5), (got, want)


class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x, use_head):
        y = self.body(x)
        return self.head(y).sum() if use_head else y.sum()


def _used_on_one_replica(mesh_shape):
    mesh = _mesh(mesh_shape)
    torch.manual_seed(0)
    model = _TwoHeads()
    fully_shard(model, mesh=mesh)
    model(torch.ones(2, 4), use_head=dist.get_rank() == 0).backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mesh_shape", [(2, 1), (1, 2)], ids=["replicas", "shards"])
def test_parameter_used_on_one_replica_gets_a_gradient_everywhere(mesh_shape):
    """One process on the global batch gives ``head`` a gradient, so every
    rank must (the used flags are agreed across replicas, not only shards)."""
    per_rank = run_distributed(2, _used_on_one_replica, mesh_shape, timeout=60)
    for grads in per_rank:
        assert grads["head.weight"] is not None and grads["head.bias"] is not None, grads
    if mesh_shape == (2, 1):  # replicas hold the same (whole) gradient
        for name in per_rank[0]:
            assert torch.equal(per_rank[0][name], per_rank[1][name]), name
