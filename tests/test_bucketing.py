"""Bucketing across units (issue 22, [Note: bucketing] in
``buffers/coalesced.py``): the same numbers bit for bit as without it, fewer
collectives, counted, and the unsharded memory bound kept."""

import pytest
import torch
import torch.distributed as dist

from fsdp_compose import PrefetchPolicy
from fsdp_compose.runtime.buckets import RECOMMENDED_BUCKET_CAP_MB
from fsdp_compose.runtime.state import state_of
from fsdp_compose.testing import GPT, GPTConfig
from tests._comm_counter import ALL_GATHER as AG, REDUCE_SCATTER as RS, CollectiveCounter
from tests._training import local_batch, make_optimizer, shard_blocks_and_root
from tests.harness import run_distributed

CFG = GPTConfig(n_layers=5)
RECOMMENDED = RECOMMENDED_BUCKET_CAP_MB


def _train(cap_mb, optim_name, steps=4, count=False):
    """Every rank: ``steps`` steps with ``set_bucket_cap_mb(cap_mb)``; the
    parameters after them, and the collectives of the last step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = shard_blocks_and_root(GPT(CFG))
    if cap_mb is not None:
        model.set_bucket_cap_mb(cap_mb)
    optim = make_optimizer(model, optim_name)
    units = [state_of(b).unit for b in model.blocks] + [state_of(model).unit]
    peak = [0]

    def probe(*_):  # the unsharded bytes at every block's forward and backward
        held = sum(b.layout.padded_numel * 4 for u in units for b in u.buffers
                   if b.is_unsharded or b.is_gathering)
        peak[0] = max(peak[0], held)
    for block in model.blocks:
        block.register_forward_pre_hook(probe)
        block.register_full_backward_pre_hook(probe)
    counts = None
    for step in range(steps):
        x, y = local_batch(step, rank, world)
        if count and step == steps - 1:
            with CollectiveCounter() as comm:
                model.loss(x, y).backward()
            counts = dict(comm.counts)
        else:
            model.loss(x, y).backward()
        optim.step()
        optim.zero_grad()
    scheduler = state_of(model).context.scheduler
    return {"params": [p.detach().clone() for p in model.parameters()],
            "all_gathers": counts and counts.get(AG, 0),
            "reduce_scatters": counts and counts.get(RS, 0),
            "buckets": [len(b.units) for b in scheduler.buckets.buckets],
            "block_bytes": sum(b.layout.padded_numel * 4 for b in units[0].buffers),
            "root_bytes": sum(b.layout.padded_numel * 4 for b in units[-1].buffers),
            "peak_unsharded": peak[0]}


@pytest.mark.parametrize("world,optim_name", [
    pytest.param(2, "adamw", marks=pytest.mark.slow), (3, "sgd")])
def test_bucketing_is_bit_identical(world, optim_name):
    off = run_distributed(world, _train, None, optim_name)  # the default: off
    on = run_distributed(world, _train, RECOMMENDED, optim_name)
    for a, b in zip(off, on):
        assert a["buckets"] == [] and b["buckets"] == [CFG.n_layers]
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))


def test_bucketing_counts_collectives_and_keeps_the_memory_bound():
    off = run_distributed(2, _train, 0, "sgd", 3, True)[0]
    on = run_distributed(2, _train, RECOMMENDED, "sgd", 3, True)[0]
    blocks = CFG.n_layers
    # off: the root once, every block in forward and backward; one reduction each
    assert (off["all_gathers"], off["reduce_scatters"]) == (1 + 2 * blocks, blocks + 1)
    # on: the root once, the bucket of all blocks in forward and in backward
    assert (on["all_gathers"], on["reduce_scatters"]) == (3, 2)
    # unsharded at once: at most max_inflight_all_gathers (2) buckets, each at most
    # the cap (here: every block), plus the root
    limit = PrefetchPolicy().max_inflight_all_gathers
    assert on["peak_unsharded"] <= on["root_bytes"] + limit * blocks * on["block_bytes"]
    assert off["peak_unsharded"] <= off["root_bytes"] + (limit + 1) * off["block_bytes"]


def test_a_cap_below_the_unit_size_changes_nothing():
    # units above the cap are never bucketed: a model of large units runs as before
    small = run_distributed(2, _train, 1e-3, "sgd", 3, True)[0]
    assert small["buckets"] == []
    assert (small["all_gathers"], small["reduce_scatters"]) == (1 + 2 * CFG.n_layers,
                                                                CFG.n_layers + 1)


def _negative_cap_raises() -> str:
    torch.manual_seed(0)
    model = shard_blocks_and_root(GPT(CFG))
    with pytest.raises(ValueError, match="set_bucket_cap_mb") as error:
        model.set_bucket_cap_mb(-1)
    return str(error.value)


def test_bucket_cap_must_not_be_negative():
    assert all(">= 0" in message for message in run_distributed(2, _negative_cap_raises))
