"""The planner's entry points: :func:`estimate_memory` and :func:`propose_units`."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.nn as nn

from ...setup.units import PlacementFn, assign_placements, placement_choices
from ..._torch_private import CAN_SWAP_STORAGE_DATA
from ...buffers.records import buffer_policy, resolve_dtypes
from ...policies import MixedPrecisionPolicy
from ...setup.torch_policies import as_mp_policy, as_offload_policy
from .._format import format_bytes
from .activations import BatchFn, fake_forward
from ...runtime.buckets import group_consecutive
from .buckets import cap_bytes, default_cap_mb, with_reshard
from .report import MemoryEstimate
from .simulation import Step, plan_unit
from .split import root_parts
from .split import split_root as split_root_units
from .units import UnitModules, UnitSpec, default_units, granularities, resolve_units

OPTIMIZER_MOMENTS = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}
"""Per-element state tensors of each optimizer (in the parameters' dtype)."""
BACKENDS = ("nccl", "gloo")


class Proposal(NamedTuple):
    """The units to pass to ``fully_shard`` in order (the root last), and
    their estimate."""

    units: list[UnitModules]
    estimate: MemoryEstimate


def estimate_memory(model: nn.Module, world_size: int, *, units: Optional[Sequence[UnitModules]] = None,
                    optimizer: str = "adamw", mp_policy: object = None,
                    offload: object = False, prefetch: int = 1, batch_fn: Optional[BatchFn] = None,
                    reshard_after_forward: Optional[bool] = None,
                    backend: Optional[str] = None, placement: object = None,
                    shard_placement_fn: Optional[PlacementFn] = None,
                    bucket_cap_mb: Optional[float] = None,
                    split_root: bool = False,
                    keep_unsharded_storage: bool = False) -> MemoryEstimate:
    """Estimate one rank's memory for training ``model`` annotated by ``units``.

    Args:
        model: the whole model, on any device (``meta`` is enough).
        world_size: ranks the units shard over.
        units: the ``fully_shard`` calls in order, ending with ``model`` (a
            list entry is one unit of siblings). Default: :func:`default_units`.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` (with momentum) or ``"none"``.
        mp_policy: every unit's mixed precision, ours or torch's.
        offload: a bool or an ``offload_policy`` (ours or torch's).
        prefetch: units all-gathered ahead of the running one.
        batch_fn: one forward of one rank's batch (``lambda m: m.loss(x, y)``),
            run on fake tensors to measure activations and forward order.
        reshard_after_forward, placement, shard_placement_fn: ``fully_shard``'s,
            for every unit.
        backend: ``"nccl"`` or ``"gloo"``; ``None``: this machine's.
        bucket_cap_mb: ``set_bucket_cap_mb``'s; ``None``: the default.
        split_root: plan ``fully_shard_root(model)`` instead.
        keep_unsharded_storage: plan ``set_keep_unsharded_storage(True)``.

    Raises:
        ValueError: an unknown option, units not ending with ``model``, or a
            parameter shared by two units (naming it)."""
    mp_policy = as_mp_policy(mp_policy, "estimate_memory")
    if not isinstance(offload, bool):
        offload = as_offload_policy(offload, "estimate_memory") is not None
    backend_assumed = backend is None
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    for name, value, allowed in (("optimizer", optimizer, OPTIMIZER_MOMENTS),
                                 ("backend", backend, BACKENDS)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {sorted(allowed)}, got {value!r}")
    if world_size < 1 or prefetch < 0:
        raise ValueError(f"need world_size >= 1 and prefetch >= 0, got {world_size}, {prefetch}")
    offload = offload and backend == "nccl"  # on a CPU mesh offload changes nothing
    cap_mb = default_cap_mb() if bucket_cap_mb is None else float(bucket_cap_mb)
    cap = cap_bytes(cap_mb)
    units = default_units(model) if units is None else list(units)
    prologue = epilogue = None
    if split_root:
        units, prologue, epilogue = split_root_units(model, units)
    specs = resolve_units(model, units)
    for spec in specs:
        assign_placements(spec.records, placement,
                          placement_choices(spec.records, shard_placement_fn), world_size,
                          steps_on_cpu=backend == "gloo")
    plans = [plan_unit(s, world_size, mp_policy or MixedPrecisionPolicy(), offload)
             for s in specs]
    order = module_order(model, specs[:-1])
    unit_acts, root_acts, ran = [0] * len(specs), [0], order
    if batch_fn is not None:
        ran, unit_acts, root_acts = fake_forward(model, [s.modules for s in specs[:-1]],
                                                  batch_fn)
        order = ran + [i for i in order if i not in ran]
    forward = [plans[-1]] + [plans[i] for i in order]  # the root first
    kept = frozenset(1 + order.index(i) for i in (prologue, epilogue) if i is not None)
    # buckets follow the forward order; the root and units not run stay alone
    keys = [None] + [with_reshard(forward[j].bucket_key,
                                  reshard_after_forward is not False and j not in kept)
                     for j in range(1, len(ran) + 1)] + [None] * (len(order) - len(ran))
    step = Step(forward, [0] + [unit_acts[i] for i in order],
                root_acts, OPTIMIZER_MOMENTS[optimizer], optimizer.startswith("adam"),
                offload, backend == "gloo", backend == "gloo" and world_size > 1, prefetch,
                reshard_after_forward,
                buckets=group_consecutive([sum(p.unsharded) for p in forward], keys, cap),
                kept=kept, pooling=CAN_SWAP_STORAGE_DATA, root_late_grads=0 if split_root else
                _late_root_grads(model, units, specs[-1], mp_policy),
                keep_unsharded=keep_unsharded_storage)
    return step.estimate(world_size, backend,
                         None if batch_fn is None else sum(unit_acts) + sum(root_acts),
                         backend_assumed, cap_mb)


def module_order(model: nn.Module, specs: Sequence[UnitSpec]) -> list[int]:
    """The units (indices into ``specs``) in module registration order: the
    forward order assumed without ``batch_fn``."""
    position = {id(m): k for k, m in enumerate(model.modules())}
    return sorted(range(len(specs)), key=lambda i: min(position[id(m)] for m in specs[i].modules))


def _late_root_grads(model: nn.Module, units: Sequence[UnitModules], root: UnitSpec,
                     mp_policy: Optional[MixedPrecisionPolicy]) -> int:
    """Bytes of the root's gradients that arrive only at the end of backward."""
    parts = root_parts(model, units)
    if parts.shared is not None:
        return 0
    early = {id(p) for m in parts.prologue for p in m.parameters()}
    policy = buffer_policy(mp_policy or MixedPrecisionPolicy(), None, cuda_available=False)
    return sum(r.param.numel() * resolve_dtypes(r.param.dtype, policy).compute.itemsize
               for r in root.records if r.param.requires_grad and id(r.param) in early)


def propose_units(model: nn.Module, world_size: int, budget_bytes: int,
                  **estimate_kwargs: Any) -> Proposal:
    """The coarsest annotation whose ``total_peak`` fits ``budget_bytes``: the
    root alone, then every block and the root, then each step's new units
    split into their children. A module sharing a parameter with one outside
    it is never a unit of its own. ``estimate_kwargs`` go to
    :func:`estimate_memory`.

    Raises:
        ValueError: nothing fits (the message shows the best estimate)."""
    best: Optional[Proposal] = None
    for units in granularities(model):
        estimate = estimate_memory(model, world_size, units=units, **estimate_kwargs)
        if estimate.total_peak <= budget_bytes:
            return Proposal(units, estimate)
        if best is None or estimate.total_peak < best.estimate.total_peak:
            best = Proposal(units, estimate)
    raise ValueError(
        f"no annotation fits {format_bytes(budget_bytes)} per rank on {world_size} ranks; the best "
        f"({best.estimate.num_units} units) needs {format_bytes(best.estimate.total_peak)}:\n"
        f"{best.estimate}\nTry more ranks, mixed precision, offload or a larger budget.")
