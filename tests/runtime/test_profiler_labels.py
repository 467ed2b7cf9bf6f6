"""Profiler labels: every hook moment and every collective's issue and wait
is a named range in a torch profiler trace (``fsdp_compose/runtime/tracing.py``)."""

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from fsdp_compose.runtime.state import state_of
from tests._training import build_model, global_batch, make_optimizer, shard_blocks_and_root
from tests.harness import run_distributed


def labels_of_three_steps(bucket_cap_mb: float) -> tuple[list[str], set[str]]:
    """(unit names, the fsdp_compose:: ranges recorded over three steps)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard_blocks_and_root(build_model())
    model.set_bucket_cap_mb(bucket_cap_mb)
    optim = make_optimizer(model, "sgd")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(3):
            x, y = global_batch(step, world, "plain")
            model.loss(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
            optim.step()
            optim.zero_grad()
    units = [state_of(m).unit.name for m in model.modules() if state_of(m) is not None]
    return units, {e.name for e in prof.events() if e.name.startswith("fsdp_compose::")}


def test_every_hook_moment_and_collective_is_a_named_range():
    units, labels = run_distributed(2, labels_of_three_steps, 0)[0]
    assert len(units) == 4  # three blocks and the root
    for unit in units:
        for moment in ("pre_forward", "post_forward", "pre_backward", "post_backward",
                       "all_gather", "all_gather_wait"):
            assert f"fsdp_compose::{moment} {unit}" in labels, (moment, unit, sorted(labels))
    for label in ("lazy_init", "end_of_backward", "reduce_scatter", "reduce_scatter_wait"):
        assert any(name.split(" ")[0] == f"fsdp_compose::{label}" for name in labels), label


def test_a_bucket_gathers_and_reduces_under_one_range():
    """Steps 1 and 2 are verified unbucketed; step 3 runs the buckets."""
    units, labels = run_distributed(2, labels_of_three_steps, 4)[0]
    assert any(name.startswith("fsdp_compose::all_gather bucket of ") for name in labels)
    assert any(name.startswith("fsdp_compose::reduce_scatter bucket of ") for name in labels)


def test_without_a_profiler_no_range_and_no_name_is_made():
    from fsdp_compose.runtime.tracing import profiled
    built = []

    def subject() -> str:
        built.append(1)
        return "u"
    first, second = profiled("pre_forward", subject), profiled("post_forward", subject)
    assert first is second and built == []  # one shared no-op context, no name built
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with profiled("pre_forward", subject):
            torch.ones(1)
    assert built == [1]
    assert "fsdp_compose::pre_forward u" in {e.name for e in prof.events()}
