"""Hybrid sharding: the all-reduce over the replicas is issued without
waiting for it and overlaps the rest of backward (issue 22), with the same
numbers as one process on the global batch."""

import torch.distributed as dist

from fsdp_compose import fully_shard
from fsdp_compose.runtime.state import state_of
from tests._training import _local, build_model, global_batch, make_optimizer, train_reference
from tests.harness import run_distributed
from tests.test_hsdp import _assert_parity, _mesh, _named_unsharded


def _train_watching_replicas(optim_name, steps=3):
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh((2, 2))
    model = build_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_bucket_cap_mb(0)  # one reduction per unit: several in turn
    optim = make_optimizer(model, optim_name)
    buffers = [b for m in [*model.blocks, model] for b in state_of(m).unit.buffers]
    in_flight = []

    def probe(*_):  # replica all-reduces still in flight when a block's backward starts
        in_flight.append(sum(b.grad._replica is not None for b in buffers))
    for block in model.blocks:
        block.register_full_backward_pre_hook(probe)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, world, "plain")
        loss = model.loss(_local(x, rank, world), _local(y, rank, world))
        loss.backward()
        assert not any(b.grad.is_reducing for b in buffers), "in flight after backward"
        optim.step()
        optim.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    model.unshard(recurse=True)
    params = {n: p.detach().clone() for n, p in _named_unsharded(model)}
    model.reshard(recurse=True)
    return {"losses": losses, "params": params, "max_in_flight": max(in_flight)}


def test_replica_all_reduce_overlaps_backward():
    results = run_distributed(4, _train_watching_replicas, "adamw", timeout=120)
    assert all(r["max_in_flight"] >= 1 for r in results), [r["max_in_flight"] for r in results]
    _assert_parity(results, train_reference(4, "adamw"))
