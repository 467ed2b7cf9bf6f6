"""Which planned units share their collectives: the runtime's own
``group_consecutive`` on the planned units' keys.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch

from ...runtime import buckets as runtime_buckets

BucketKey = Optional[Hashable]
"""What one bucket's units share; ``None``: never bucketed."""


def default_cap_mb() -> float:
    """The library's default cap, read now (a setting, not a constant)."""
    return float(runtime_buckets.DEFAULT_BUCKET_CAP_MB)


cap_bytes = runtime_buckets.cap_bytes


def unit_key(compute: Sequence[torch.dtype], reduce_comm: Sequence[torch.dtype],
             aliased: bool, offload: bool) -> BucketKey:
    """A planned unit's bucket key, the runtime's ``_key`` on what the planner
    models."""
    if not compute or aliased or offload or len(set(compute)) != 1 or len(set(reduce_comm)) > 1:
        return None
    return compute[0], next(iter(reduce_comm), None)


def with_reshard(key: BucketKey, reshards_after_forward: bool) -> BucketKey:
    """``key`` and whether the unit reshards after forward (kept units never
    bucket with resharding ones)."""
    return None if key is None else (key, reshards_after_forward)
