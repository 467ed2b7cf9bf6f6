"""Which planned units share their collectives: the runtime's rule.

The grouping is ``runtime/buckets.py``'s own ``group_consecutive`` (what
``BucketPlan.rebuild`` runs): in forward order, consecutive units that
qualify (a key that is not ``None``, at most the cap unsharded) and share a
key, greedily while the group's unsharded bytes stay within the cap; a group
of one unit is no bucket; a cap of 0 turns bucketing off. Here: the keys of
planned units (``unit_key``, ``with_reshard``: the runtime's ``_key`` on what
the planner models) and the default cap. ``tests/tools/test_planner.py`` checks
that the planner's buckets are the runtime's on real models.
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


cap_bytes = runtime_buckets.cap_bytes  # the runtime's conversion and check, shared


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
