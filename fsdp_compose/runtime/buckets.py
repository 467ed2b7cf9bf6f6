"""Which units share their collectives: buckets of consecutive small units
([Note: bucketing] in ``collective_queue.py`` has the collectives).

A :class:`BucketPlan` is rebuilt from the forward order of the step that
just ended, at the end of its last backward, right after the ranks checked
that they issued the same collectives (``CollectiveQueue.order_agreed``):
the plan is the same on every rank, which is why a bucket's collectives can
have a fixed size. Iterations that verify every collective across ranks run
unbucketed, and so do models that never run backward.

Consecutive qualifying units with the same key (process group, compute
dtype, communication dtype and wire formats, reduce options, gradient sync,
whether they reshard after forward) are grouped greedily while the bucket's
unsharded bytes stay within ``cap_bytes`` (0: no buckets); a bucket of one
unit is no bucket. A unit qualifies when its unsharded bytes are at most
``cap_bytes`` and nothing about it needs a collective of its own: not the
root, no explicit prefetch targets, no ``reshard_after_forward=k`` group, no
``reduce_scatter_unused_params``, all-gathers in backward, no CPU offload,
one process group and compute dtype over its buffers, none aliased.

Backward reaches the last bucket of the forward order first, where the
activations peak: its members are gathered one by one there
(``gathered_in_backward`` False), so its packed output never sits on top of
that peak; its gradients are still reduced as one.

Memory: a bucket counts as one all-gather against
``max_inflight_all_gathers``, so the unsharded bytes in flight are at most
that limit times ``max(cap_bytes, largest unit)``; a bucket's gradients are
held until its last member's backward (at most ``cap_bytes``).
"""

from __future__ import annotations

from typing import Container, Hashable, Optional, Protocol, Sequence

from ..buffers.flat_buffer import FlatBuffer
from .training_state import TrainingState
from .unit_protocols import BucketedUnit

DEFAULT_BUCKET_CAP_MB = 2.0
"""Units above it (a large model's blocks) run exactly as without
bucketing; a bucket's packed transients scale with it (BENCHMARKS.md has
the measurements behind the value). ``set_bucket_cap_mb(0)`` turns it off."""


def cap_bytes(cap_mb: float, where: str = "") -> int:
    """A bucket cap in MiB as bytes (truncated), checked: ``where`` starts
    the message of the error a negative cap raises."""
    if cap_mb < 0:
        raise ValueError(f"{where}bucket_cap_mb must be >= 0 MiB (0 turns bucketing off), "
                         f"got {cap_mb}")
    return int(cap_mb * 2 ** 20)

class HasBucketCap(Protocol):
    """What the plan reads of the model's settings (``ModelSettings``,
    whose module imports this one for :data:`DEFAULT_BUCKET_CAP_MB`)."""

    bucket_cap_mb: float


class Bucket:
    """Consecutive units (forward order) whose collectives are coalesced."""

    def __init__(self, units: list[BucketedUnit]) -> None:
        self.units: list[BucketedUnit] = units
        self.buffers: list[FlatBuffer] = [b for u in units for b in u.buffers]
        self.gathered_in_backward: bool = True
        """False for the first bucket backward reaches: its members are
        gathered one by one there (see the module docstring)."""

    def gather_members(self, unit: BucketedUnit, issuer_state: TrainingState,
                       ran: Container[int]) -> list[BucketedUnit]:
        """The members to all-gather with ``unit`` now: ``unit`` and those
        whose use is still ahead: in forward, those whose forward has not
        run in this pass (``ran``: ids of the units that did); in backward,
        those whose backward has not started and will run."""
        backward = issuer_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)
        if backward:
            return [m for m in self.units if m is unit or (
                m.training_state is TrainingState.IDLE and m.backward_possible)]
        return [m for m in self.units if m is unit or id(m) not in ran]

    def reduced_buffers(self) -> list[FlatBuffer]:
        """What the bucket's reduce-scatter carries, whichever members have
        a gradient (zeros for the others): the trainable buffers of the
        members that synchronize gradients, the same on every rank."""
        return [b for u in self.units if u.settings.requires_gradient_sync for b in u.trainable_buffers]

    def expected_reduces(self) -> list[FlatBuffer]:
        """The buffers whose gradients this backward should reduce together."""
        return [b for u in self.units if u.backward_possible and u.settings.requires_gradient_sync
                for b in u.trainable_buffers]


class BucketPlan:
    """The buckets of one model for the running iteration."""

    def __init__(self, settings: HasBucketCap) -> None:
        self.settings: HasBucketCap = settings
        """The model's settings (``ModelSettings``)."""
        self.cap_mb: float = settings.bucket_cap_mb
        """The cap the plan was built with."""
        self.cap_bytes: int = cap_bytes(self.cap_mb)
        self.buckets: list[Bucket] = []
        self._of_unit: dict[int, Bucket] = {}
        self._of_buffer: dict[int, Bucket] = {}
        self._order: list[BucketedUnit] = []
        """The forward order the plan was built from (the last agreed one)."""

    def refresh(self) -> None:
        """At a root forward (no bucket holds anything): re-bucket the last
        agreed order if ``settings.bucket_cap_mb`` changed (every rank
        changes it at the same point: a model setting)."""
        if self.settings.bucket_cap_mb != self.cap_mb:
            self.cap_mb = self.settings.bucket_cap_mb
            self.cap_bytes = cap_bytes(self.cap_mb)
            self.rebuild(self._order)

    def rebuild(self, order: Sequence[BucketedUnit]) -> None:
        """Bucket ``order`` (a forward order every rank agreed on)."""
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
    """The buckets (index lists) of units with unsharded ``sizes`` (bytes)
    and ``keys`` in forward order: consecutive units with the same key that
    is not ``None``, each and all together at most ``cap_bytes``, grouped
    greedily; only groups of two or more. Pure: the memory planner
    (``tools/planner``) groups its planned units with it too."""
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
    """What must agree between the units of one bucket; ``None``: the unit
    needs collectives of its own (see the module docstring)."""
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
    comm = {(b.reduce_comm_dtype, b.reduce_quantizer) for b in buffers if b.requires_grad}
    wires = {b.gather_quantizer for b in buffers}
    if len(groups) != 1 or len(dtypes) != 1 or len(comm) > 1 or len(wires) != 1:
        return None
    return (groups.pop(), id(buffers[0].group.replicate_process_group), dtypes.pop(),
            next(iter(comm), None), wires.pop(), settings.reduce_options,
            settings.requires_gradient_sync, unit.resolved_reshard_after_forward,
            None if settings.comms is None else settings.comms.key())
