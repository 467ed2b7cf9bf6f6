"""Which units share their collectives: buckets of consecutive small units
([Note: bucketing] in ``collective_queue.py`` has the collectives).

The plan is rebuilt from a step's forward order only at the end of its last
backward, once the ranks checked they issued the same collectives
(``CollectiveQueue.order_agreed``): it is the same on every rank, so a
bucket's collectives have a fixed size. Iterations that verify every
collective run unbucketed, as do models that never run backward.

Consecutive units with equal :func:`_key` are grouped greedily while the
bucket's unsharded bytes stay within the cap (0: no buckets); a bucket of
one is none. A unit qualifies when it fits the cap and needs no collective
of its own (see :func:`_key`).

Backward reaches the last bucket first, where activations peak: there its
members are gathered one by one (``gathered_in_backward`` False), so its
packed output never adds to that peak; its gradients are still reduced as
one.

Memory: a bucket counts as one all-gather against
``max_inflight_all_gathers``, so the unsharded bytes in flight are at most
that limit times ``max(cap, largest unit)``; a bucket's gradients are held
until its last member's backward (at most the cap).
"""

from __future__ import annotations

from typing import Container, Hashable, Optional, Protocol, Sequence

from ..buffers.flat_buffer import FlatBuffer
from .training_state import TrainingState
from .protocols import BucketedUnit

DEFAULT_BUCKET_CAP_MB = 2.0
"""Units above it (a large model's blocks) run as unbucketed; a bucket's
packed transients scale with it (BENCHMARKS.md). 0 turns bucketing off."""


def cap_bytes(cap_mb: float, where: str = "") -> int:
    """MiB as bytes (truncated); ``where`` starts the error for a negative cap."""
    if cap_mb < 0:
        raise ValueError(f"{where}bucket_cap_mb must be >= 0 MiB (0 turns bucketing off), "
                         f"got {cap_mb}")
    return int(cap_mb * 2 ** 20)

class HasBucketCap(Protocol):
    """What the plan reads of ``ModelSettings`` (whose module imports this one)."""

    bucket_cap_mb: float


class Bucket:
    """Consecutive units (forward order) whose collectives are coalesced."""

    def __init__(self, units: list[BucketedUnit]) -> None:
        self.units: list[BucketedUnit] = units
        self.buffers: list[FlatBuffer] = [b for u in units for b in u.buffers]
        self.gathered_in_backward: bool = True
        """False for the first bucket backward reaches (module docstring)."""

    def gather_members(self, unit: BucketedUnit, issuer_state: TrainingState,
                       ran: Container[int]) -> list[BucketedUnit]:
        """``unit`` and the members whose use is still ahead: in forward,
        not in ``ran``; in backward, not started and going to run."""
        backward = issuer_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)
        if backward:
            return [m for m in self.units if m is unit or (
                m.training_state is TrainingState.IDLE and m.backward_possible)]
        return [m for m in self.units if m is unit or id(m) not in ran]

    def reduced_buffers(self) -> list[FlatBuffer]:
        """What the reduce-scatter carries, the same on every rank whichever
        members have a gradient: trainable buffers of syncing members."""
        return [b for u in self.units if u.settings.requires_gradient_sync for b in u.trainable_buffers]

    def expected_reduces(self) -> list[FlatBuffer]:
        return [b for u in self.units if u.backward_possible and u.settings.requires_gradient_sync
                for b in u.trainable_buffers]


class BucketPlan:
    """The buckets of one model for the running iteration."""

    def __init__(self, settings: HasBucketCap) -> None:
        self.settings: HasBucketCap = settings
        self.cap_mb: float = settings.bucket_cap_mb
        self.cap_bytes: int = cap_bytes(self.cap_mb)
        self.buckets: list[Bucket] = []
        self._of_unit: dict[int, Bucket] = {}
        self._of_buffer: dict[int, Bucket] = {}
        self._order: list[BucketedUnit] = []
        """The last agreed forward order."""

    def refresh(self) -> None:
        """At a root forward (no bucket holds anything): re-bucket the last
        agreed order if the cap changed (a model setting: every rank
        changes it at the same point)."""
        if self.settings.bucket_cap_mb != self.cap_mb:
            self.cap_mb = self.settings.bucket_cap_mb
            self.cap_bytes = cap_bytes(self.cap_mb)
            self.rebuild(self._order)

    def rebuild(self, order: Sequence[BucketedUnit]) -> None:
        """``order``: a forward order every rank agreed on."""
        self.buckets, self._of_unit, self._of_buffer = [], {}, {}
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
            self._of_unit[id(unit)] = bucket
        for buffer in bucket.buffers:
            self._of_buffer[id(buffer)] = bucket

    def of_unit(self, unit: BucketedUnit) -> Optional[Bucket]:
        return self._of_unit.get(id(unit))

    def of_buffer(self, buffer: FlatBuffer) -> Optional[Bucket]:
        return self._of_buffer.get(id(buffer))



def group_consecutive(sizes: Sequence[int], keys: Sequence[Optional[Hashable]],
                      cap_bytes: int) -> list[list[int]]:
    """Index lists of consecutive units with the same key (not ``None``),
    each and all together at most ``cap_bytes``, grouped greedily; only
    groups of two or more. Pure: ``tools/planner`` uses it too."""
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
    collectives (the root, explicit prefetch, a ``reshard_after_forward=k``
    group, unused-params reduction, no backward all-gather, CPU offload,
    buffers of mixed groups, dtypes or wire formats, aliased or meta)."""
    settings = unit.settings
    if unit.is_root or not unit.buffers or settings.forward_prefetch is not None or \
            settings.backward_prefetch is not None or settings.post_forward_group is not None or \
            settings.reduce_scatter_unused_params or not settings.unshard_in_backward or \
            settings.offload_policy is not None:
        return None
    buffers = unit.buffers
    if any(b.aliased or b.is_meta for b in buffers):
        return None
    groups = {id(b.group.process_group) for b in buffers}
    dtypes = {b.compute_dtype for b in buffers}
    comm = {b.reduce_comm_dtype for b in buffers if b.requires_grad}
    wires = {b.wire.key() for b in buffers}
    if len(groups) != 1 or len(dtypes) != 1 or len(comm) > 1 or len(wires) != 1:
        return None
    return (groups.pop(), id(buffers[0].group.replicate_process_group), dtypes.pop(),
            next(iter(comm), None), wires.pop(), settings.reduce_options,
            settings.requires_gradient_sync, unit.resolved_reshard_after_forward)
