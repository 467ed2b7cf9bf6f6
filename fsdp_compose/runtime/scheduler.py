"""Overlap: which all-gathers to issue early, and how many collectives may be
in flight at once.

One :class:`Scheduler` is shared by every unit of a model: the root's lazy
init builds it (with the model's :class:`PrefetchPolicy` and collective
observer) and hands it to every unit. It records the order in which units run
forward, prefetches by that order, bounds the all-gathers in flight (which
bounds unsharded memory) and the reduce-scatters in flight (each holds a full
flat gradient alive until it completes).

On CPU/gloo the collectives are ``async_op=True`` work handles that the
process group runs on its own threads; on CUDA/NCCL they run on NCCL's stream
and ``wait()`` only orders the compute stream after them, so the host never
blocks on the device.
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Protocol

from ..buffers.coalesced import gather_coalesced, reduce_coalesced
from ..buffers.flat_buffer import FlatBuffer
from ..buffers.flat_grad import ReduceOptions
from ..buffers.staging import StagingPool
from ..policies import PrefetchPolicy
from ..profiling import profiled
from .buckets import Bucket, BucketPlan
from .observer import CollectiveObserver
from .training_state import TrainingState


class ScheduledUnit(Protocol):
    """What the scheduler reads of a unit (``unit.ShardUnit``, which
    imports this module)."""

    name: str
    buffers: list[FlatBuffer]
    training_state: TrainingState
    unshard_in_backward: bool
    backward_possible: bool
    forward_prefetch: Optional[list["ScheduledUnit"]]
    backward_prefetch: Optional[list["ScheduledUnit"]]


class Scheduler:
    """Forward order, prefetching and in-flight limits for one model."""

    def __init__(self, policy: PrefetchPolicy = PrefetchPolicy(),
                 observer: Optional[CollectiveObserver] = None) -> None:
        self.policy: PrefetchPolicy = policy
        self.forward_order: list["ScheduledUnit"] = []
        """Units in the order their forward started in this iteration."""
        self.previous_forward_order: list["ScheduledUnit"] = []
        """The same for the previous iteration (used by forward prefetch)."""
        self._positions: dict[int, int] = {}
        self._previous_positions: dict[int, int] = {}
        """id(unit) -> its index in ``forward_order`` / ``previous_forward_order``
        (prefetch looks units up once per unit: no scan of the order)."""
        self._gathers: list[list[FlatBuffer]] = []
        """All-gathers issued here that may still be in flight: the buffers
        each one fills (several for a bucket)."""
        self._reduces: deque[list[FlatBuffer]] = deque()
        """Reduce-scatters in flight, oldest first: the buffers of each."""
        self._replicas: deque[list[FlatBuffer]] = deque()
        """Hybrid sharding: the buffers whose reduce-scatter finished and
        whose all-reduce over the replicas is in flight, oldest first."""
        self.buckets: BucketPlan = BucketPlan()
        """Which units share their collectives in this iteration
        (``buckets.py``; rebuilt where the ranks agree, :meth:`order_agreed`)."""
        self._held: dict[int, tuple[Bucket, list[FlatBuffer], ReduceOptions]] = {}
        """Per bucket (by id): its buffers whose gradient is ready, held
        until the bucket's last one is (:meth:`reduce`)."""
        self.staging: StagingPool = StagingPool()
        """Memory of released unsharded buffers, reused on the CPU."""
        self.observer: CollectiveObserver = observer or CollectiveObserver()
        """Sees every collective issued here, before it is issued (the rank
        divergence checks, [Note: rank divergence] in ``checks/divergence.py``)."""

    def share_staging_pool(self, buffers: list[FlatBuffer]) -> None:
        """Make ``buffers`` (of a unit joining this model) use the shared
        staging pool; only CPU buffers, see ``buffers/staging.py``."""
        for buffer in buffers:
            if buffer.compute_device.type == "cpu" and not buffer.is_unsharded \
                    and not buffer.aliased:
                buffer.staging = self.staging

    # ---------------------------------------------------------------- order
    def start_iteration(self) -> None:
        """Called at the root's pre-forward: a new forward order begins."""
        if self.forward_order:
            self.previous_forward_order = self.forward_order
            self._previous_positions = self._positions
        self.forward_order, self._positions = [], {}
        self.buckets.refresh()
        self.observer.start_iteration()

    def order_agreed(self) -> None:
        """Called at the end of the step's last backward, once every rank
        has checked that its collectives, forward order included, were the
        same as every other rank's (the fingerprint in ``publish_gradients``,
        which raises otherwise): rebuild the buckets from that forward order.
        The plan therefore changes only where the ranks agree on it, so it is
        the same on every rank. Iterations that verify every collective
        (the first two by default, [Note: rank divergence]) run unbucketed:
        their checks then name the unit whose collective differs, and they
        pay a blocking check per buffer anyway."""
        verifying = self.observer.will_verify()
        self.buckets.rebuild([] if verifying else self.forward_order or self.previous_forward_order)

    def discard_iteration(self) -> None:
        """Forget an iteration that raised (``reset_iter_state``): its partial
        forward order (forward prefetch keeps following the last complete
        one) and the collectives it tracked, which the units have waited.

        Pre-condition: no buffer is gathering or reducing any more."""
        self.forward_order, self._positions = [], {}
        self._gathers = []
        self._reduces.clear()
        self._replicas.clear()
        self._held = {}

    def record_forward(self, unit: "ScheduledUnit") -> None:
        if id(unit) not in self._positions:
            self._positions[id(unit)] = len(self.forward_order)
            self.forward_order.append(unit)

    def forward_targets(self, unit: "ScheduledUnit",
                        order: Optional[list["ScheduledUnit"]] = None) -> list["ScheduledUnit"]:
        """The units to all-gather before ``unit``'s forward: its explicit
        targets, else the unit after it in ``order`` (default: the previous
        iteration's forward order)."""
        if unit.forward_prefetch is not None:
            return list(unit.forward_prefetch)
        if not self.policy.forward:
            return []
        if order is not None:
            return _after(order, unit)
        position = self._previous_positions.get(id(unit))
        return self.previous_forward_order[position + 1:position + 2] if position is not None else []

    def backward_targets(self, unit: "ScheduledUnit",
                         order: Optional[list["ScheduledUnit"]] = None) -> list["ScheduledUnit"]:
        """The units to all-gather when ``unit``'s backward starts: its
        explicit targets, else the unit before it in ``order`` (default:
        this iteration's forward order) that all-gathers in backward."""
        if unit.backward_prefetch is not None:
            return list(unit.backward_prefetch)
        if not self.policy.backward:
            return []
        if order is None:
            order, position = self.forward_order, self._positions.get(id(unit))
        else:
            position = next((i for i, u in enumerate(order) if u is unit), None)
        if position is None:
            return []
        for earlier in range(position - 1, -1, -1):  # the nearest that all-gathers in backward
            if order[earlier].unshard_in_backward:
                return [order[earlier]]
        return []

    def recorded_order(self) -> list["ScheduledUnit"]:
        """The running (else the last complete) forward's order; empty
        before the first forward. What the next iteration prefetches by
        (``tools/describe.py`` reports it with the two methods above)."""
        return self.forward_order or self.previous_forward_order

    # ------------------------------------------------------------ all-gather
    def gather(self, unit: "ScheduledUnit", prefetch: list["ScheduledUnit"]) -> None:
        """Unshard ``unit``, issuing the all-gathers of ``prefetch`` while
        its own is in flight (within the limit). A unit in a bucket is
        gathered with the rest of its bucket, by one all-gather."""
        # forget finished gathers first: a bucket gathered again would revive its old
        # entry next to the new one and count twice against the in-flight limit
        self.inflight_all_gathers()
        if not self._start_bucket(unit, unit):
            for buffer in unit.buffers:
                self._start_unshard(unit, buffer, unit)
        for target in prefetch:
            if self._start_bucket(unit, target, limited=True):
                continue
            for buffer in target.buffers:
                if buffer.aliased:
                    # One rank: nothing to fetch ahead. Unsharding would only swap the
                    # module attributes, and a unit that then does not run would keep
                    # the views (the root drops only prefetches still gathering).
                    continue
                if buffer.is_unsharded and not buffer.is_stale or buffer.is_gathering:
                    continue  # nothing to issue: already gathered or in flight
                if self.inflight_all_gathers() >= self.policy.max_inflight_all_gathers:
                    break
                self._start_unshard(unit, buffer, target)
        with profiled("all_gather_wait", unit.name):
            for buffer in unit.buffers:
                buffer.finish_unshard()

    def inflight_all_gathers(self) -> int:
        """All-gathers issued here and not waited on yet (a bucket's is one)."""
        self._gathers = [g for g in self._gathers if any(b.is_gathering for b in g)]
        return len(self._gathers)

    def _start_bucket(self, issuer: "ScheduledUnit", unit: "ScheduledUnit",
                      limited: bool = False) -> bool:
        """If ``unit`` is in a bucket: issue one all-gather for the members
        that need one (``limited``: only within the in-flight limit) and
        return True; else False (nothing done)."""
        bucket = self.buckets.of_unit(unit)
        if bucket is None:
            return False
        members = bucket.gather_members(unit, issuer.training_state,
                                        {id(u) for u in self.forward_order})
        buffers = [b for m in members for b in m.buffers if _issues_all_gather(b)]
        if not buffers:
            return True  # nothing to issue: already gathered or in flight
        if limited and self.inflight_all_gathers() >= self.policy.max_inflight_all_gathers:
            return True
        for buffer in buffers:
            self.observer.before_all_gather(buffer, issuer.training_state)
        with profiled("all_gather", lambda: "bucket of " + ", ".join(m.name for m in members)):
            gathering = gather_coalesced(bucket.buffers, buffers)
        if gathering:
            self._gathers.append(gathering)
        for buffer in buffers:
            if not buffer.is_gathering and not buffer.is_unsharded:
                buffer.start_unshard()  # could not join (kept post-forward piece); observed above
                self._track(buffer)
        return True

    def _start_unshard(self, issuer: "ScheduledUnit", buffer: FlatBuffer,
                       owner: "ScheduledUnit") -> None:
        """Issue ``buffer``'s all-gather (``owner``'s) for ``issuer``'s
        pre-forward or pre-backward (``owner`` is another unit when
        prefetching)."""
        if _issues_all_gather(buffer):
            self.observer.before_all_gather(buffer, issuer.training_state)
        with profiled("all_gather", owner.name):
            buffer.start_unshard()
        self._track(buffer)

    def _track(self, buffer: FlatBuffer) -> None:
        if buffer.is_gathering and not any(b is buffer for g in self._gathers for b in g):
            self._gathers.append([buffer])

    # -------------------------------------------------------- reduce-scatter
    def reduce(self, buffer: FlatBuffer, options: ReduceOptions) -> None:
        """Issue ``buffer``'s reduce-scatter; wait the oldest ones beyond the
        limit. A buffer of a bucket is held until the bucket's last expected
        gradient is ready; then one reduce-scatter goes for all of them."""
        self._forget_reducing(buffer)
        bucket = self.buckets.of_buffer(buffer)
        if bucket is not None:
            _, ready, _ = self._held.setdefault(id(bucket), (bucket, [], options))
            if not any(b is buffer for b in ready):
                ready.append(buffer)
            expected = bucket.expected_reduces()
            if all(any(b is e for b in ready) for e in expected):
                self._reduce_held(id(bucket), buffer)
            return
        if buffer.grad.has_unreduced:
            self.observer.before_reduce_scatter(buffer)
        with profiled("reduce_scatter"):
            started = buffer.grad.start_reduce(options)
        if started:
            self._reduces.append([buffer])
        self._keep_reduce_limit()

    def _forget_reducing(self, buffer: FlatBuffer) -> None:
        if buffer.grad.is_reducing:  # still in flight from an earlier backward of this step
            self._reduces, self._replicas = (
                deque(g for g in ([b for b in g if b is not buffer] for g in queue) if g)
                for queue in (self._reduces, self._replicas))

    def _reduce_held(self, key: int, trigger: Optional[FlatBuffer] = None) -> None:
        """One reduce-scatter for the bucket; ``trigger``: the buffer whose
        gradient completed it, observed first (the rank-divergence checks
        then name the unit whose backward made a rank reduce the bucket)."""
        bucket, _, options = self._held.pop(key)
        buffers = bucket.reduced_buffers()
        observed = [trigger] if trigger is not None else []
        for buffer in observed + [b for b in buffers if b is not trigger]:
            if buffer.grad.has_unreduced:
                self.observer.before_reduce_scatter(buffer)
        with profiled("reduce_scatter", lambda: f"bucket of {len(buffers)} buffers"):
            reducing = reduce_coalesced(buffers, options)
        if reducing:
            self._reduces.append(reducing)
        self._keep_reduce_limit()

    def _keep_reduce_limit(self) -> None:
        """Beyond the limit, the oldest reduce-scatter is waited; under
        hybrid sharding its all-reduce over the replicas is then issued and
        waited only when those exceed the limit in turn (or at the end)."""
        while len(self._reduces) > self.policy.max_pending_reduces:
            oldest = self._reduces.popleft()
            with profiled("reduce_scatter_wait"):
                replicating = [b for b in oldest if b.grad.advance_reduce()]
            if replicating:
                self._replicas.append(replicating)
        while len(self._replicas) > self.policy.max_pending_reduces:
            with profiled("all_reduce_replicas_wait"):
                for buffer in self._replicas.popleft():
                    buffer.grad.finish_reduce()

    def flush_held_reduces(self) -> None:
        """End of backward: reduce what buckets still hold (a member whose
        backward did not run), bucket by bucket in plan order, the same on
        every rank."""
        for bucket in self.buckets.buckets:
            if id(bucket) in self._held:
                self._reduce_held(id(bucket))

    def finish_reduces(self) -> None:
        with profiled("reduce_scatter_wait", "all in flight"):
            for queue in (self._replicas, self._reduces):  # oldest first
                while queue:
                    for buffer in queue.popleft():
                        buffer.grad.finish_reduce()

    # -------------------------------------------------------------- staging
    def end_iteration(self) -> None:
        """The iteration's last use of unsharded memory is over (end of the
        last backward, or a forward without backward): release the staging
        pool unless the policy retains it between iterations."""
        if self.policy.retain_staging:
            self.staging.keep()
        else:
            self.staging.clear()


def _issues_all_gather(buffer: FlatBuffer) -> bool:
    """Whether ``buffer.start_unshard()`` would issue a collective now."""
    return not buffer.aliased and not buffer.is_gathering and \
        (not buffer.is_unsharded or buffer.is_stale)


def _after(order: list["ScheduledUnit"], unit: "ScheduledUnit") -> list["ScheduledUnit"]:
    """The unit right after ``unit`` in ``order`` (empty if none)."""
    for index, candidate in enumerate(order):
        if candidate is unit:
            return order[index + 1:index + 2]
    return []
