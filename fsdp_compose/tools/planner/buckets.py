"""Which planned units share their collectives: ``runtime/buckets.py``'s
rule (``BucketPlan.rebuild``), restated over plain sizes and keys.

The runtime groups live units; the planner has byte counts. The rule is the
same: in forward order, consecutive units that qualify (a key that is not
``None``, at most ``cap_bytes`` unsharded) and share a key are grouped
greedily while the group's unsharded bytes stay within ``cap_bytes``; a group
of one unit is no bucket; ``cap_bytes <= 0`` turns bucketing off.
``tests/test_planner.py`` checks that this gives the runtime's buckets on a
real model.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch

from ...runtime import buckets as runtime_buckets

BucketKey = Optional[Hashable]
"""What must agree between the units of one bucket; ``None``: never bucketed."""


def default_cap_mb() -> float:
    """The library's default cap, read now (it is a setting that changes
    between releases, not a constant of the planner)."""
    return float(runtime_buckets.DEFAULT_BUCKET_CAP_MB)


def cap_bytes(cap_mb: float) -> int:
    """``BucketPlan.set_cap_mb``'s conversion (MiB, truncated to bytes)."""
    if cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be >= 0 (0 turns bucketing off), got {cap_mb}")
    return int(cap_mb * 2 ** 20)


def unit_key(compute: Sequence[torch.dtype], reduce_comm: Sequence[torch.dtype],
             aliased: bool, offload: bool) -> BucketKey:
    """A planned unit's bucket key (``runtime/buckets.py``'s ``_key`` on
    what the planner models: one process group, the same reduce options
    and prefetch settings on every unit).

    Args:
        compute: the compute dtype of each of its flat buffers.
        reduce_comm: the reduce-scatter dtype of each trainable buffer.
        aliased: a buffer needs no all-gather (one rank).
        offload: CPU offload.
    """
    if not compute or aliased or offload or len(set(compute)) != 1 or len(set(reduce_comm)) > 1:
        return None
    return compute[0], next(iter(reduce_comm), None)


def with_reshard(key: BucketKey, reshards_after_forward: bool) -> BucketKey:
    """``key`` with whether the unit reshards after forward: units kept
    unsharded until backward (the split root's parts) are never bucketed
    with units that reshard (the runtime's key holds
    ``resolved_reshard_after_forward``)."""
    return None if key is None else (key, reshards_after_forward)


def group_buckets(sizes: Sequence[int], keys: Sequence[BucketKey],
                  cap: int) -> list[list[int]]:
    """The buckets (lists of indices, each at least two, consecutive) of
    units with unsharded ``sizes`` (bytes) and ``keys``, in forward order.

    Invariant: every bucket's sizes sum to at most ``cap``, its keys are
    equal and not ``None``, and its indices are consecutive.
    """
    if cap <= 0:
        return []  # off
    buckets: list[list[int]] = []
    current: list[int] = []
    current_key: BucketKey = None
    total = 0
    for index, (size, key) in enumerate(zip(sizes, keys)):
        if size > cap:
            key = None
        if key is None or key != current_key or total + size > cap:
            buckets.append(current)
            current, current_key, total = [], key, 0
        if key is not None:
            current.append(index)
            total += size
    buckets.append(current)
    return [b for b in buckets if len(b) >= 2]
