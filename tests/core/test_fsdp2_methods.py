"""FSDP2's module methods that change the collectives: the replica
all-reduce once per step under hybrid sharding, the reduction hook,
custom all-gathers and reduce-scatters (buckets included), a separate
reduce-scatter group, and what the CUDA-only ones do on a CPU mesh.

Run: ``PYTHONPATH=. python -m pytest -q tests/core/test_fsdp2_methods.py``.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import fully_shard
from fsdp_compose.runtime.state import state_of, states_below
from fsdp_compose.testing import synthetic_tokens
from tests._comm_counter import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CollectiveCounter
from tests._training import CFG, build_model
from tests.harness import run_distributed
from tests.parallelism.test_hsdp import unsharded_params

MICRO = 3
LR = 0.05


def _batch(step: int, world: int):
    return synthetic_tokens(step, world * MICRO, CFG.seq_len, CFG.vocab_size, seed=11)


def _sgd(model, lr=LR):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def _reference(world: int, lr: float = LR, steps: int = 3) -> dict:
    """One process on the global batch."""
    model = build_model()
    optim = _sgd(model, lr)
    for step in range(steps):
        x, y = _batch(step, world)
        model.loss(x, y).backward()
        optim.step()
        optim.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class _Allocating:
    """Counts allocations; plain ``torch.empty``."""

    def allocate(self, size, *, dtype, device):
        self.allocated += 1
        return torch.empty(*size, dtype=dtype, device=device)


class CountingAllGather(_Allocating, AllGather):
    """torch's protocol (not exported by torch.distributed.fsdp); delegates to
    ``dist``, counting calls and allocations."""

    def __init__(self) -> None:
        self.calls = 0
        self.allocated = 0

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(_Allocating, ReduceScatter):
    def __init__(self) -> None:
        self.calls = 0
        self.allocated = 0

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                          async_op=async_op)


class GroupNames(CollectiveCounter):
    """Counts (op, process group name) besides the base counts."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            for arg in args:
                if type(arg).__name__ == "ScriptObject":
                    try:
                        self.by_name[func, dist.ProcessGroup.unbox(arg).group_name] += 1
                        break
                    except RuntimeError:
                        continue
        return super().__torch_dispatch__(func, types, args, kwargs)


def _train(mesh_shape, setup: str, steps: int = 3, count_step: int = 2) -> dict:
    """Every rank: blocks then the root on ``mesh_shape``, ``MICRO``
    micro-batches per step, ``setup`` applied; the full parameters after
    ``steps`` and the collectives of step ``count_step``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = build_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    modules = [*model.blocks, model]
    gather, scatter = CountingAllGather(), CountingReduceScatter()
    if setup == "hook-half":
        for module in modules:
            module.set_all_reduce_hook(lambda t: t.mul_(0.5))
    elif setup == "custom":
        for module in modules:
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
    elif setup == "separate-group":
        model.set_separate_reduce_scatter_group()
    optim = _sgd(model)
    out = {}
    for step in range(steps):
        x, y = _batch(step, world)
        xs, ys = x[rank * MICRO:(rank + 1) * MICRO].chunk(MICRO), y[rank * MICRO:(rank + 1) * MICRO].chunk(MICRO)
        counter = GroupNames()
        before = (gather.calls, scatter.calls)
        with counter if step == count_step else contextlib.nullcontext():
            for i, (a, b) in enumerate(zip(xs, ys)):
                if setup == "all-reduce-once":
                    model.set_requires_all_reduce(i == MICRO - 1)
                (model.loss(a, b) / MICRO).backward()
        if step == count_step:
            shard = mesh["shard"].get_group().group_name
            replicate = mesh["replicate"].get_group().group_name if len(mesh_shape) == 2 else None
            out["counts"] = {
                "all_gather": counter.by_name[ALL_GATHER, shard],
                "reduce_scatter": counter.by_name[REDUCE_SCATTER, shard],
                "replica_all_reduce": counter.by_name[ALL_REDUCE, replicate],
                "reduce_scatter_elsewhere": sum(n for (f, g), n in counter.by_name.items()
                                                if f == REDUCE_SCATTER and g != shard),
                "custom": (gather.calls - before[0], scatter.calls - before[1]),
                "buckets": len(model_context(model).collectives.buckets.buckets),
            }
        optim.step()
        optim.zero_grad()
    out["params"] = unsharded_params(model)
    return out


def _states(model):
    return states_below((model,))


def model_context(model):
    return state_of(model).context


def _assert_params(results, reference, atol=1e-5):
    for rank, res in enumerate(results):
        for name, want in reference.items():
            diff = (res["params"][name] - want).abs().max().item()
            assert diff <= atol, f"rank {rank}: {name} differs by {diff}"


def test_requires_all_reduce_once_per_step_under_hsdp():
    """(2, 2) mesh, 3 micro-batches: every micro-batch reduce-scatters in
    the shard group, the replica all-reduce runs for the last one only,
    and the parameters match one process on the global batch."""
    once = run_distributed(4, _train, (2, 2), "all-reduce-once", timeout=240)
    every = run_distributed(4, _train, (2, 2), "plain", timeout=240)
    for a, b in zip(once, every):
        assert a["counts"]["reduce_scatter"] == b["counts"]["reduce_scatter"] > 0
        assert b["counts"]["replica_all_reduce"] == MICRO * a["counts"]["replica_all_reduce"] > 0
    reference = _reference(4)
    _assert_params(once, reference)
    _assert_params(every, reference)


def test_all_reduce_hook_sees_every_reduction_and_its_changes_count():
    """A hook halving each reduce-scatter output trains like SGD with half
    the learning rate, on 3 ranks (FSDP) and on a (2, 2) mesh (after the
    replica all-reduce)."""
    _assert_params(run_distributed(3, _train, (3,), "hook-half", timeout=180), _reference(3, LR / 2))
    _assert_params(run_distributed(4, _train, (2, 2), "hook-half", timeout=240), _reference(4, LR / 2))


def test_custom_comms_carry_every_collective_buckets_included():
    """On 3 ranks, with the counted step bucketed: every all-gather and
    reduce-scatter of the step went through the custom objects, and
    training matches one process."""
    results = run_distributed(3, _train, (3,), "custom", timeout=180)
    for res in results:
        counts = res["counts"]
        assert counts["buckets"] > 0
        assert counts["custom"] == (counts["all_gather"], counts["reduce_scatter"])
        assert counts["all_gather"] > 0 and counts["reduce_scatter"] > 0
    _assert_params(results, _reference(3))


def test_separate_reduce_scatter_group():
    """Reduce-scatters run on the separate group (none on the shard group)
    and training matches one process."""
    results = run_distributed(3, _train, (3,), "separate-group", timeout=180)
    for res in results:
        assert res["counts"]["reduce_scatter"] == 0
        assert res["counts"]["reduce_scatter_elsewhere"] > 0
    _assert_params(results, _reference(3))


def _cpu_only_methods() -> dict:
    import warnings
    model = build_model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    seen = {}
    with pytest.raises(RuntimeError, match="SymmetricMemory does not find allocation backend"):
        model.set_symm_mem_for_comm()
    model.set_allocate_memory_from_process_group_for_comm(True)
    seen["plain_path"] = all(b.comms is None for s in _states(model) for b in s.unit.buffers)
    model.set_post_optim_event(torch.Event("cpu"))
    with pytest.raises(ValueError, match="positive"):
        model.set_reduce_scatter_max_input_buffers(0)
    with pytest.raises(TypeError, match="must be an int"):
        model.set_reduce_scatter_max_input_buffers(True)
    model.set_reduce_scatter_max_input_buffers(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.blocks[0].set_reduce_scatter_divide_factor(2.0)
    seen["warning"] = [(w.category.__name__, str(w.message)) for w in caught]
    seen["factor"] = state_of(model.blocks[0]).unit.settings.reduce_options.divide_factor
    x, y = _batch(0, 1)
    model.loss(x[:1], y[:1]).backward()
    seen["pending"] = model_context(model).settings.prefetch_policy.max_pending_reduces
    with pytest.raises(TypeError, match="allocate"):
        model.set_custom_all_gather(object())
    return seen


def test_cpu_mesh_behaviour_of_the_cuda_settings_and_the_aliases():
    for seen in run_distributed(2, _cpu_only_methods, timeout=120):
        assert seen["plain_path"]
        assert seen["warning"] == [("DeprecationWarning", "Use `set_gradient_divide_factor` instead")]
        assert seen["factor"] == 2.0
        assert seen["pending"] == 2
