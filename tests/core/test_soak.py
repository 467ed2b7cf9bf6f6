"""Soak: many training steps on a tiny model at world size 2, every feature on
at once, asserting that nothing accumulates from step to step.

Run the short variant (CI, a few seconds)::

    PYTHONPATH=. python -m pytest -q tests/core/test_soak.py -m "not slow"

and the long one (500 steps unless ``FSDP_COMPOSE_SOAK_STEPS`` says more)::

    FSDP_COMPOSE_SOAK_STEPS=2000 PYTHONPATH=. python -m pytest -q tests/core/test_soak.py -m slow

Features, all in the same model: a mixed-precision unit (bf16 compute, fp32
reduce), a CPU-offloaded unit, prefetch both ways, composable activation
checkpointing of the blocks, two micro-batches (the first without gradient
sync), clipping with ``fsdp_compose.clip_grad_norm_``, AdamW, and a
``state_dict()`` every ``SAVE_EVERY`` steps (collective: every rank calls it).

Per rank, measured at the end of every step (after ``gc.collect()``):
live tensors found by ``gc.get_objects()`` and the bytes of their storages
(plus loose ``UntypedStorage`` objects, e.g. the CPU staging pool), tensors
still holding an autograd graph, all gc-tracked objects, hooks (module
forward/backward hooks, hooks on the flat buffers' unsharded tensors, global
optimizer hooks) and the process RSS. After warm-up none of the counts may
grow; in the long run (``-m slow``) RSS may grow by a small slack only (what
the process holds moves with the allocator and gloo's threads, so the short
run counts what the library allocates only). Step time is not asserted
here: timings belong in benchmarks (``benchmarks/``), a test must not
depend on the machine's load.
"""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compose import (CPUOffloadPolicy, MixedPrecisionPolicy, PrefetchPolicy, clip_grad_norm_,
                          fully_shard)
from tests._owners import buffer_of
from tests._models import build_lm, lm_loss, rank_slice, token_batch
from tests.harness import run_distributed, shutdown_pools

WORLD = 2
SHORT_STEPS = 40
LONG_STEPS = int(os.environ.get("FSDP_COMPOSE_SOAK_STEPS", "500"))
SAVE_EVERY = 5
CENSUSES = 8  # gc.get_objects() censuses per run
MICRO = 2
PER_RANK = 4
RSS_SLACK = 2 << 20  # bytes: allocator noise on a tiny model


def _build() -> nn.Module:
    from torch.distributed._composable import checkpoint
    model = build_lm(n_blocks=3)
    for block in model.blocks:
        checkpoint(block)
    fully_shard(model.blocks[0], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                reduce_dtype=torch.float32,
                                                                output_dtype=torch.float32))
    fully_shard(model.blocks[1], offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model.blocks[2], reshard_after_forward=False)
    fully_shard(model)
    model.set_prefetch_policy(PrefetchPolicy(forward=True, backward=True))
    return model


def _is_storageless(tensor: torch.Tensor) -> bool:
    """A wrapper subclass with no memory of its own (a lazy checkpoint value,
    ``checkpoint/_lazy.py``): counted as a tensor, it has no storage bytes."""
    try:
        tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return True
    return False


def _has_memory(storage: torch.UntypedStorage) -> bool:
    """False for the storage of a wrapper subclass (a lazy checkpoint
    value's, kept loose by a checkpoint plan): it has no data pointer."""
    try:
        storage.data_ptr()
    except RuntimeError:
        return False
    return True


def _tensor_census() -> tuple[int, int, int, int]:
    """(live tensors, bytes of their distinct storages and of loose storages,
    tensors with a grad_fn, gc-tracked objects)."""
    time.sleep(0.05)  # gloo's worker thread may hold a finished collective's tensors a moment longer
    gc.collect()
    objects = gc.get_objects()
    tensors, with_graph, storages = 0, 0, {}
    for obj in objects:
        cls = type(obj)  # not isinstance: it reads __class__, which some objects warn on
        if issubclass(cls, torch.Tensor):
            tensors += 1
            with_graph += obj.grad_fn is not None
            if obj.device.type != "meta" and not _is_storageless(obj):
                s = obj.untyped_storage()
                storages[s.data_ptr(), s.nbytes()] = s.nbytes()
        elif cls is torch.UntypedStorage and _has_memory(obj):
            storages[obj.data_ptr(), obj.nbytes()] = obj.nbytes()
    return tensors, sum(storages.values()), with_graph, len(objects)


def _hook_count(model: nn.Module) -> int:
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
    n = len(_global_optimizer_pre_hooks) + len(_global_optimizer_post_hooks)
    for m in model.modules():
        n += sum(len(getattr(m, name)) for name in (
            "_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks",
            "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
            "_load_state_dict_post_hooks"))
    buffers = {id(b): b for p in model.parameters() if (b := buffer_of(p)) is not None}
    for buffer in buffers.values():
        for t in (buffer.unsharded, buffer.sharded):
            n += len(t._backward_hooks or {}) + len(t._post_accumulate_grad_hooks or {})
    return n


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(steps: int) -> dict:
    """Runs on every rank: ``steps`` steps; returns the per-step series
    (the census ones every ``steps // CENSUSES`` steps)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _build()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    census_every = max(1, steps // CENSUSES)
    samples: dict[str, list] = {"tensors": [], "bytes": [], "graph": [], "objects": [],
                                "hooks": [], "rss": [], "time": [], "loss": []}
    for step in range(steps):
        tokens, targets = token_batch(step, WORLD * PER_RANK)
        tokens, targets = rank_slice(tokens, rank, world), rank_slice(targets, rank, world)
        start = time.perf_counter()
        loss_sum = 0.0
        for i, (x, y) in enumerate(zip(tokens.chunk(MICRO), targets.chunk(MICRO))):
            model.set_requires_gradient_sync(i == MICRO - 1)
            loss = lm_loss(model(x), y) / MICRO
            loss.backward()
            loss_sum += loss.item()
        clip_grad_norm_(model, 1.0)
        optim.step()
        optim.zero_grad()
        if step % SAVE_EVERY == SAVE_EVERY - 1:
            state = model.state_dict()
            assert len(state) == len(list(model.parameters())) + len(list(model.buffers()))
            del state
        samples["time"].append(time.perf_counter() - start)
        samples["loss"].append(loss_sum)
        del loss, x, y
        samples["hooks"].append(_hook_count(model))
        samples["rss"].append(_rss())
        if step % census_every == census_every - 1:  # a census takes ~0.2 s
            tensors, nbytes, graph, objects = _tensor_census()
            samples["tensors"].append(tensors)
            samples["bytes"].append(nbytes)
            samples["graph"].append(graph)
            samples["objects"].append(objects)
    return samples


def _not_growing(series: list, warm: int, slack: float, what: str) -> None:
    """Nothing after index ``warm`` exceeds the value at ``warm`` by more than ``slack``."""
    settled, later = series[warm], series[warm + 1:]
    assert later and max(later) <= settled + slack, \
        f"{what} grew after warm-up: {settled}, then up to {max(later)} (series {series})"


def check_flat(per_rank: list[dict], steps: int, check_rss: bool = False) -> None:
    for rank, s in enumerate(per_rank):
        assert all(torch.isfinite(torch.tensor(s["loss"]))), f"rank {rank}: loss {s['loss']}"
        # by the end of the first quarter: optimizer state, staging pools and
        # one state_dict exist
        warm, census_warm = steps // 4, len(s["tensors"]) // 4
        for key in ("tensors", "bytes", "graph"):
            _not_growing(s[key], census_warm, 0, f"rank {rank}: {key}")
        _not_growing(s["hooks"], warm, 0, f"rank {rank}: hooks")
        # gc-tracked objects: Python's own caches may still settle a little
        # (a leak of one object per step would not fit this slack)
        _not_growing(s["objects"], census_warm, 32, f"rank {rank}: gc objects")
        if check_rss:
            _not_growing(s["rss"], warm, RSS_SLACK, f"rank {rank}: RSS")


def test_soak_short():
    per_rank = run_distributed(WORLD, soak, SHORT_STEPS, timeout=120)
    check_flat(per_rank, SHORT_STEPS)


@pytest.mark.slow
def test_soak_long():
    # fresh workers: the RSS of a process that ran earlier tests moves with what
    # they left to the allocator (one jump of 3.8 MiB in a -m slow run, flat after)
    shutdown_pools()
    per_rank = run_distributed(WORLD, soak, LONG_STEPS, timeout=60 + 0.5 * LONG_STEPS)
    check_flat(per_rank, LONG_STEPS, check_rss=True)
