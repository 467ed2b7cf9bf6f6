"""The model's path ([Note: the local path] in
``fsdp_compose/runtime/unit_paths.py``): chosen once per model, chosen
again when a buffer is rebuilt or a unit's collectives are replaced, and
the same with a profiler recording (which only adds ranges).

Run: ``PYTHONPATH=. python -m pytest -q tests/runtime/test_unit_paths.py``
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from fsdp_compose import MixedPrecisionPolicy, materialize
from fsdp_compose.runtime.state import units_below
from tests._training import build_model, local_batch, make_optimizer, shard_blocks_and_root
from tests.harness import run_distributed

TIMEOUT = 120


def _paths(model) -> set[str]:
    return {type(unit.path).__name__ for unit in units_below(model)}


def _step(model, optim, step: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = local_batch(step, rank, world)
    model.loss(x, y).backward()
    optim.step()
    optim.zero_grad()


class _CountingAllGather:
    """torch's ``AllGather`` protocol over the library's own collective."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                           async_op=async_op)


def paths_as_the_model_changes() -> dict[str, set[str]]:
    out = {}
    model = shard_blocks_and_root(build_model())
    optim = make_optimizer(model, "sgd")
    _step(model, optim, 0)
    out["plain"] = _paths(model)
    model.to(torch.float64)  # rebuilt: still aliased over one rank
    out["converted"] = _paths(model)
    model.blocks[0].set_custom_all_gather(_CountingAllGather())
    out["custom all-gather"] = _paths(model)
    _step(model, make_optimizer(model, "sgd"), 1)
    with torch.device("meta"):
        meta = build_model()
    shard_blocks_and_root(meta)
    materialize(meta)
    _step(meta, make_optimizer(meta, "sgd"), 0)
    out["materialized"] = _paths(meta)
    mixed = shard_blocks_and_root(
        build_model(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    _step(mixed, make_optimizer(mixed, "sgd"), 0)
    out["mixed precision blocks"] = _paths(mixed)
    return out


def test_one_rank_takes_the_local_path_until_something_must_cross_ranks():
    """Local over one rank (also after ``module.to`` and ``materialize``);
    the collective path once a unit's all-gather is the user's, or where a
    buffer has a copy to gather into (mixed precision), or over two ranks."""
    result, = run_distributed(1, paths_as_the_model_changes, timeout=TIMEOUT)
    assert result == {"plain": {"LocalPath"}, "converted": {"LocalPath"},
                      "custom all-gather": {"CollectivePath"}, "materialized": {"LocalPath"},
                      "mixed precision blocks": {"CollectivePath"}}
    for two_ranks in run_distributed(2, paths_as_the_model_changes, timeout=TIMEOUT):
        assert set().union(*two_ranks.values()) == {"CollectivePath"}


def train_with_and_without_profiler() -> dict:
    """Two steps of the same model, without and with a profiler recording."""
    results = {}
    for profiled in (False, True):
        model = shard_blocks_and_root(build_model())
        optim = make_optimizer(model, "adamw")
        if profiled:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for step in range(2):
                    _step(model, optim, step)
            labels = {e.name for e in prof.events() if e.name.startswith("fsdp_compose::")}
        else:
            for step in range(2):
                _step(model, optim, step)
            labels = set()
        results[profiled] = {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "paths": _paths(model),
            "hookless": sorted(u.name for u in units_below(model) if u.backward_without_hook),
            "labels": labels,
            "block": units_below(model)[1].name,
        }
    off, on = results[False], results[True]
    return {
        "equal": all(torch.equal(off["params"][n], on["params"][n]) for n in off["params"]),
        "paths": (off["paths"], on["paths"]),
        "hookless": (off["hookless"], on["hookless"]),
        "labels": on["labels"],
        "block": on["block"],
    }


def test_a_profiler_adds_ranges_and_changes_no_path():
    result, = run_distributed(1, train_with_and_without_profiler, timeout=TIMEOUT)
    assert result["equal"]
    assert result["paths"] == ({"LocalPath"}, {"LocalPath"})
    off, on = result["hookless"]
    assert off == on and len(off) == 3  # the three blocks; the root keeps its hook
    labels = result["labels"]
    for moment in ("pre_forward", "post_forward", "post_backward"):  # no pre-backward hook
        assert f"fsdp_compose::{moment} {result['block']}" in labels, (moment, sorted(labels))
