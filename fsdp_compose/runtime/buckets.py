"""Which units share their collectives: the plan of a step, made at the
root's pre-forward. ``CollectiveQueue`` runs what it plans.

[Note: bucketing]
Consecutive small units share one all-gather and one reduce-scatter,
packed: ``out.view(F, T)[:, off_i:off_i+S_i]`` is buffer ``i``'s
``unsharded.view(F, S_i)``. Results are bit-identical to unbucketed. A
bucket's collectives carry *every* member (zeros where no gradient), so
ranks whose control flow differs still pair, and the fingerprint names the
difference ([Note: rank divergence]).

[Note: a bucket's copies]
A member's storage is allocated and filled from the packed output when
it is completed, the packed output freed after the last copy: the start
of backward holds only the members in use. A wire with
``fills_members_at_completion`` false fills all at the wait.

The plan follows a forward order only once the ranks checked they issued
the same collectives (``CollectiveQueue.order_agreed``), so it is the same
on every rank. Consecutive units with equal :func:`_key` are grouped
greedily within the cap (0: none). Backward gathers the last bucket's
members one by one (``gathered_in_backward``), where activations peak. A
bucket counts as one all-gather against ``max_inflight_all_gathers``; its
gradients are held until its last member's backward.
"""

from __future__ import annotations

from typing import Hashable, Optional, Protocol, Sequence

from ..buffers.flat_buffer import FlatBuffer
from .protocols import BucketedUnit

DEFAULT_BUCKET_CAP_MB = 2.0
"""Larger units run unbucketed; 0 turns bucketing off."""


def cap_bytes(cap_mb: float, where: str = "") -> int:
    """MiB as bytes; ``where`` starts the error for a negative cap."""
    if cap_mb < 0:
        raise ValueError(f"{where}bucket_cap_mb must be >= 0 MiB (0 turns bucketing off), "
                         f"got {cap_mb}")
    return int(cap_mb * 2 ** 20)

class HasBucketCap(Protocol):
    """What the plan reads of ``ModelSettings``."""

    bucket_cap_mb: float


class Bucket:
    """Consecutive units whose collectives are coalesced; data only (the
    queue decides what happens to it in a step)."""

    __slots__ = ("units", "buffers", "gathered_in_backward")

    def __init__(self, units: list[BucketedUnit]) -> None:
        self.units: list[BucketedUnit] = units
        self.buffers: list[FlatBuffer] = [b for u in units for b in u.buffers]
        self.gathered_in_backward: bool = True
        """False for the first bucket backward reaches."""


class BucketPlan:
    """The buckets of one model for the running iteration. Read during a
    step through its attributes only; rebuilt between steps."""

    def __init__(self, settings: HasBucketCap) -> None:
        self.settings: HasBucketCap = settings
        self.cap_mb: float = settings.bucket_cap_mb
        self.cap_bytes: int = cap_bytes(self.cap_mb)
        self.buckets: list[Bucket] = []
        self.by_unit: dict[int, Bucket] = {}
        """By unit id."""
        self.by_buffer: dict[int, Bucket] = {}
        """By buffer id."""
        self._order: list[BucketedUnit] = []
        """The last agreed forward order."""

    def refresh(self, agreed: Optional[Sequence[BucketedUnit]]) -> None:
        """At the root's pre-forward: re-bucket from ``agreed`` (the order the
        last step agreed; ``None``: none since), or from the last order if the
        cap changed."""
        if self.settings.bucket_cap_mb != self.cap_mb:
            self.cap_mb = self.settings.bucket_cap_mb
            self.cap_bytes = cap_bytes(self.cap_mb)
            if agreed is None:
                agreed = self._order
        if agreed is not None:
            self.rebuild(agreed)

    def rebuild(self, order: Sequence[BucketedUnit]) -> None:
        """``order``: agreed by every rank."""
        self.buckets, self.by_unit, self.by_buffer = [], {}, {}
        self._order = list(order)
        if self.cap_bytes <= 0:
            return
        sizes = [_unsharded_bytes(unit) for unit in self._order]
        keys = [_key(unit) if size <= self.cap_bytes else None
                for unit, size in zip(self._order, sizes)]
        for group in group_consecutive(sizes, keys, self.cap_bytes):
            self._close([self._order[i] for i in group])
        if self.buckets:
            self.buckets[-1].gathered_in_backward = False

    def _close(self, units: list[BucketedUnit]) -> None:
        if len(units) < 2:
            return
        bucket = Bucket(units)
        self.buckets.append(bucket)
        for unit in units:
            self.by_unit[id(unit)] = bucket
        for buffer in bucket.buffers:
            self.by_buffer[id(buffer)] = bucket


def group_consecutive(sizes: Sequence[int], keys: Sequence[Optional[Hashable]],
                      cap_bytes: int) -> list[list[int]]:
    """Index lists of two or more consecutive units with the same key, within
    ``cap_bytes``, grouped greedily. Pure (``tools/planner`` uses it)."""
    groups: list[list[int]] = []
    current: list[int] = []
    current_key: Optional[Hashable] = None
    total = 0
    for index, (size, key) in enumerate(zip(sizes, keys)):
        key = key if 0 < cap_bytes and size <= cap_bytes else None
        if key is None or key != current_key or total + size > cap_bytes:
            groups.append(current)
            current, current_key, total = [], key, 0
        if key is not None:
            current.append(index)
            total += size
    groups.append(current)
    return [g for g in groups if len(g) >= 2]


def _unsharded_bytes(unit: BucketedUnit) -> int:
    return sum(b.layout.padded_numel * b.unsharded.element_size() for b in unit.buffers)


def _key(unit: BucketedUnit) -> Optional[tuple]:
    """What must agree within a bucket; ``None``: the unit needs its own
    collectives."""
    settings = unit.settings
    if unit.is_root or not unit.buffers or settings.forward_prefetch is not None or \
            settings.backward_prefetch is not None or settings.post_forward_group is not None or \
            settings.reduce_scatter_unused_params or not settings.unshard_in_backward or \
            settings.offload_policy is not None:
        return None
    buffers = unit.buffers
    if any(b.aliased or b.is_meta for b in buffers):
        return None
    groups = {b.group.key for b in buffers}
    dtypes = {b.compute_dtype for b in buffers}
    comm = {b.reduce_comm_dtype for b in buffers if b.requires_grad}
    wires = {b.wire.key() for b in buffers}
    if len(groups) != 1 or len(dtypes) != 1 or len(comm) > 1 or len(wires) != 1:
        return None
    return (groups.pop(), id(buffers[0].group.replicate_process_group), dtypes.pop(),
            next(iter(comm), None), wires.pop(), settings.reduce_options,
            settings.requires_gradient_sync, unit.resolved_reshard_after_forward)
