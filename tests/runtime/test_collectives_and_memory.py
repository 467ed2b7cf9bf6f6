"""Collective counts per training step and memory invariants.

Collectives are counted independently of the library, by torch's
``CommDebugMode`` intercepting the c10d ops. For N flat buffers the rule is
2N - (root buffers) all-gathers and one reduce-scatter per trainable buffer.
"""

import pytest
import torch
import torch.distributed as dist

from fsdp_compose import PrefetchPolicy
from fsdp_compose._torch_private import CAN_SWAP_STORAGE_DATA
from tests._owners import buffer_of
from fsdp_compose.runtime.training_state import TrainingState
from fsdp_compose.runtime.state import state_of
from fsdp_compose.testing import GPT, GPTConfig
from tests._training import (RECIPES, build_model, freeze_like_lora, global_batch,
                             make_optimizer, shard_blocks_and_root, unbucketed)
from tests._comm_counter import (ALL_GATHER as AG, ALL_REDUCE as AR, REDUCE_SCATTER as RS,
                                 CollectiveCounter)
from tests.harness import TEST_DEVICE, run_distributed

CPU_ONLY = pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="CPU only: gloo's "
                              "reduce-scatter emulation and the staging pool are the CPU's")


def _buffers(model):
    seen = {}
    for p in model.parameters():
        b = buffer_of(p)
        if b is not None:
            seen[id(b)] = b
    return list(seen.values())


def _units(model):
    seen = {}
    for m in model.modules():
        s = state_of(m)
        if s is not None:
            seen[id(s)] = s.unit
    return list(seen.values())


def count_step_collectives(recipe: str, lora: bool, mode: str):
    """Runs on every rank: two warm-up steps, then counts the collectives of
    one more (steady-state) step. Returns (all-gathers, reduce-scatters, per-buffer RS bytes)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    if lora:
        freeze_like_lora(model)
    unbucketed(RECIPES[recipe](model))
    optim = make_optimizer(model, "sgd")

    def step(i):
        x, y = global_batch(i, world, "plain")
        per = x.shape[0] // world
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        if mode.startswith("nosync-then-"):
            model.set_requires_gradient_sync(False)
            model.loss(x, y).backward()
            model.set_requires_gradient_sync(True)
        if mode == "no_sync-context-then-sync":  # DDP's / FSDP1's context (what accelerate calls)
            with model.no_sync():
                model.loss(x, y).backward()
        if mode == "nosync-then-closure":
            # the step's backward runs inside step(closure), after the step
            # pre-hooks (LBFGS; Lightning's automatic optimization)
            def closure():
                loss = model.loss(x, y)
                loss.backward()
                return loss
            optim.step(closure)
        else:
            model.loss(x, y).backward()
            optim.step()
        optim.zero_grad()

    step(0)
    step(1)  # the first two iterations also verify the collective order across ranks
    with CollectiveCounter() as comm:  # (tests/checks/test_rank_divergence.py counts those)
        step(2)
    counts = comm.counts
    buffers = _buffers(model)
    return {
        "other_collectives": sum(counts.values()) - counts[AG] - counts[RS] - counts[AR],
        "all_reduces": counts.get(AR, 0),
        "all_gathers": counts.get(AG, 0),
        "reduce_scatters": counts.get(RS, 0),
        "buffers": len(buffers),
        "root_buffers": len(next(u for u in _units(model) if u.is_root).buffers),
        "trainable_buffers": sum(b.requires_grad for b in buffers),
        "frozen_only_units": sum(all(not b.requires_grad for b in u.buffers) and bool(u.buffers)
                                 for u in _units(model)),
    }


@pytest.mark.parametrize("recipe,lora,mode", [
    ("blocks+root", False, "plain"),
    ("blocks+root", True, "plain"),
    ("siblings", False, "plain"),
    ("no-reshard-after-forward", False, "plain"),
    ("blocks+root", False, "nosync-then-sync"),
    ("blocks+root", False, "nosync-then-closure"),
    ("blocks+root", False, "no_sync-context-then-sync"),
])
def test_collectives_per_step(recipe, lora, mode):
    res = run_distributed(2, count_step_collectives, recipe, lora, mode)[0]
    n, root, trainable = res["buffers"], res["root_buffers"], res["trainable_buffers"]
    backward_gathers = 0 if recipe == "no-reshard-after-forward" else n - root
    per_backward = n + backward_gathers
    backwards = 2 if "then-" in mode else 1
    assert res["all_gathers"] == backwards * per_backward
    # one reduce-scatter per trainable buffer, only on the synced backward;
    # frozen-only units never reduce-scatter
    assert res["reduce_scatters"] == trainable
    # one tiny all-reduce per synced backward: which parameters some rank used
    assert res["all_reduces"] == 1
    assert res["other_collectives"] == 0
    if lora:
        assert res["frozen_only_units"] == 1 and trainable < n
    if recipe == "blocks+root" and not lora:
        assert (n, trainable) == (4, 4)  # the exact numbers: 7 all-gathers, 4 reduce-scatters


def _counted_bytes_of_plain_collectives():
    """torch's own collectives under the counter: an all-reduce (whose c10d
    op takes a list of tensors) and an all-gather into one tensor."""
    x = torch.ones(10, dtype=torch.float32)
    gathered = torch.empty(20 * dist.get_world_size(), dtype=torch.float16)
    with CollectiveCounter() as comm:
        dist.all_reduce(x)
        dist.all_gather_into_tensor(gathered, torch.ones(20, dtype=torch.float16))
    return {"all_reduce": comm.bytes[AR], "all_gather": comm.bytes[AG],
            "dtypes": sorted(str(d) for ds in comm.dtypes.values() for d in ds)}


def test_collective_counter_counts_the_bytes_of_list_arguments():
    for res in run_distributed(2, _counted_bytes_of_plain_collectives):
        assert res == {"all_reduce": 40, "all_gather": 2 * 20 * 2,
                       "dtypes": ["torch.float16", "torch.float32"]}


def gloo_all_reduce_path(via_all_reduce: bool):
    """One step (after two warm-up steps) with the gloo reduce-scatter done as
    an in-place all-reduce, or not; returns the counts by op and the
    gradients of every rank's shard."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    unbucketed(RECIPES["blocks+root"](model))
    optim = make_optimizer(model, "sgd")
    for i in range(3):
        x, y = global_batch(i, world, "plain")
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        with CollectiveCounter(gloo_all_reduce=via_all_reduce) as comm:
            model.loss(x, y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optim.step()
        optim.zero_grad()
    return {"reduce_scatters": comm.counts.get(RS, 0), "all_reduces": comm.counts.get(AR, 0),
            "trainable_buffers": sum(b.requires_grad for b in _buffers(model)), "grads": grads}


@CPU_ONLY
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_reduce_scatter_as_all_reduce_is_bit_identical(world):
    """[Note: gloo reduce-scatter as an all-reduce]: same gradients to the
    bit after three steps, one all-reduce in place of each reduce-scatter."""
    emulated = run_distributed(world, gloo_all_reduce_path, True)
    portable = run_distributed(world, gloo_all_reduce_path, False)
    for a, b in zip(emulated, portable):
        assert a["reduce_scatters"] == 0 and b["reduce_scatters"] == b["trainable_buffers"]
        assert a["all_reduces"] == b["all_reduces"] + b["trainable_buffers"]  # + used flags
        assert all(torch.equal(g, h) for g, h in zip(a["grads"], b["grads"]))


def memory_invariants():
    """Runs on every rank: checks storage after a step and how many units are
    unsharded at once during forward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    freeze_like_lora(model)
    RECIPES["blocks+root"](model)
    optim = make_optimizer(model, "adamw")
    units = _units(model)
    peak_unsharded_units = []

    def probe(module, args):
        peak_unsharded_units.append(sum(u.is_unsharded for u in units))
    for block in model.blocks:
        block.register_forward_pre_hook(probe)  # runs after fully_shard's (prepended) hook

    x, y = global_batch(0, world, "plain")
    per = x.shape[0] // world
    model.loss(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
    optim.step()

    report = {"peak_unsharded_units": max(peak_unsharded_units),
              "states": {u.name: u.training_state for u in units}}
    for b in _buffers(model):
        assert b.unsharded.untyped_storage().nbytes() == 0, f"{b} keeps unsharded storage"
        assert not b.is_unsharded
        if not b.requires_grad:
            assert b.grad.sharded_grad is None, "frozen buffer allocated a gradient"
        assert b.sharded.numel() == b.layout.shard_numel
    for name, p in model.named_parameters():
        b = buffer_of(p)
        assert p.untyped_storage().data_ptr() == b.sharded.untyped_storage().data_ptr(), name
        if not p.requires_grad:
            assert p.grad is None, f"frozen {name} has a gradient"
        elif p.numel():
            assert p.grad.untyped_storage().data_ptr() == b.grad.sharded_grad.untyped_storage().data_ptr()
        for state in optim.state.get(p, {}).values():
            if torch.is_tensor(state) and state.ndim:
                assert state.numel() == p.numel(), f"optimizer state of {name} is not sharded"
    local = sum(p.numel() for p in model.parameters())
    full = sum(b.layout.numel for b in _buffers(model))
    report["local_over_full"] = local / full
    optim.zero_grad(set_to_none=True)
    report["grads_freed"] = all(b.grad.sharded_grad is None for b in _buffers(model))
    return report


@pytest.mark.parametrize("world", [2, 4])
def test_memory_invariants(world):
    for rep in run_distributed(world, memory_invariants):
        # root + the block running: never two blocks at once when resharding after forward
        assert rep["peak_unsharded_units"] == 2
        assert all(s is TrainingState.IDLE for s in rep["states"].values())
        assert rep["local_over_full"] <= 1 / world + 0.05
        assert rep["grads_freed"]  # zero_grad(set_to_none=True) releases the sharded gradients


def staging_pool_is_reused(retain: bool):
    """The unsharded memory released by resharding is lent again: the first
    step pools nothing, then the pool holds no more than the peak
    unsharded working set: the root and three blocks (in backward: the block
    whose gradient is still accumulating, the running one, the prefetched one).
    Without ``retain_staging`` it is empty between steps, and at the end of
    every forward (the loss and the start of backward, where a step's
    activations peak: [Note: the pool across the end of forward])."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layers=6))  # more blocks than the bound, so holding all would show
    unbucketed(RECIPES["blocks+root"](model))
    model.set_prefetch_policy(PrefetchPolicy(retain_staging=retain))
    optim = make_optimizer(model, "sgd")
    sizes, after_forward = [], []
    for step in range(3):
        x, y = global_batch(step, world, "plain")
        per = x.shape[0] // world
        loss = model.loss(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        pool = state_of(model).context.collectives.staging  # the model's, built at lazy init
        after_forward.append(pool.pooled_bytes)
        loss.backward()
        optim.step()
        optim.zero_grad()
        sizes.append(pool.pooled_bytes)
    root_bytes = sum(b.layout.padded_numel * 4 for b in state_of(model).unit.buffers)
    block_bytes = sum(b.layout.padded_numel * 4 for b in state_of(model.blocks[0]).unit.buffers)
    return sizes, after_forward, root_bytes, block_bytes


@pytest.mark.skipif(not CAN_SWAP_STORAGE_DATA, reason="this torch has no "
                    "UntypedStorage._swap_data_ptr_ (torch<2.12): the staging pool is off")
def test_staging_pool_is_reused():
    sizes, after_forward, root_bytes, block_bytes = run_distributed(
        2, staging_pool_is_reused, True)[0]
    assert sizes[0] == 0 and sizes[1] == sizes[2] > 0
    assert root_bytes + 2 * block_bytes <= sizes[1] <= root_bytes + 3 * block_bytes
    assert after_forward[2] > 0  # retained through the forward too


@CPU_ONLY
def test_staging_pool_is_released_between_steps_and_after_forward_by_default():
    sizes, after_forward, _, _ = run_distributed(2, staging_pool_is_reused, False)[0]
    assert sizes == [0, 0, 0]
    assert after_forward == [0, 0, 0]


def _unit_freed_after_model_dropped(with_state_dict: bool) -> bool:
    """Train a step (and optionally save state dicts), drop every reference,
    and report whether the units were freed. Autograd keeps hooks in C++,
    where a strong reference back to a buffer forms a cycle Python's garbage
    collector cannot see; a leaked unit also keeps its process group alive."""
    import gc
    import weakref
    model = shard_blocks_and_root(build_model("gpt"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = global_batch(0, dist.get_world_size(), "plain")
    model.loss(x, y).backward()
    optim.step()
    if with_state_dict:
        model.state_dict()
        optim.state_dict()
    units = [weakref.ref(state_of(m).unit) for m in [*model.blocks, model]]
    del model, optim, x, y
    gc.collect()
    return all(unit() is None for unit in units)


@pytest.mark.parametrize("with_state_dict", [False, True])
def test_dropping_a_model_frees_its_units(with_state_dict):
    assert all(run_distributed(2, _unit_freed_after_model_dropped, with_state_dict))
