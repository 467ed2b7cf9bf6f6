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

from ..buffers.flat_buffer import FlatBuffer
from ..buffers.flat_grad import ReduceOptions
from ..buffers.staging import StagingPool
from ..policies import PrefetchPolicy
from .observer import CollectiveObserver
from .training_state import TrainingState


class ScheduledUnit(Protocol):
    """What the scheduler reads of a unit (``unit.ShardUnit``, which
    imports this module)."""

    buffers: list[FlatBuffer]
    training_state: TrainingState
    unshard_in_backward: bool
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
        self._gathers: list[FlatBuffer] = []
        """Buffers whose all-gather was issued here and may still be in flight."""
        self._reduces: deque[FlatBuffer] = deque()
        """Buffers with a reduce-scatter in flight, oldest first."""
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
        self.forward_order = []
        self.observer.start_iteration()

    def discard_iteration(self) -> None:
        """Forget an iteration that raised (``reset_iter_state``): its partial
        forward order (forward prefetch keeps following the last complete
        one) and the collectives it tracked, which the units have waited.

        Pre-condition: no buffer is gathering or reducing any more."""
        self.forward_order = []
        self._gathers = []
        self._reduces.clear()

    def record_forward(self, unit: "ScheduledUnit") -> None:
        if not any(u is unit for u in self.forward_order):
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
        return _after(self.previous_forward_order if order is None else order, unit)

    def backward_targets(self, unit: "ScheduledUnit",
                         order: Optional[list["ScheduledUnit"]] = None) -> list["ScheduledUnit"]:
        """The units to all-gather when ``unit``'s backward starts: its
        explicit targets, else the unit before it in ``order`` (default:
        this iteration's forward order) that all-gathers in backward."""
        if unit.backward_prefetch is not None:
            return list(unit.backward_prefetch)
        if not self.policy.backward:
            return []
        order = self.forward_order if order is None else order
        return _after([u for u in order[::-1] if u is unit or u.unshard_in_backward], unit)

    def recorded_order(self) -> list["ScheduledUnit"]:
        """The running (else the last complete) forward's order; empty
        before the first forward. What the next iteration prefetches by
        (``tools/describe.py`` reports it with the two methods above)."""
        return self.forward_order or self.previous_forward_order

    # ------------------------------------------------------------ all-gather
    def gather(self, unit: "ScheduledUnit", prefetch: list["ScheduledUnit"]) -> None:
        """Unshard ``unit``, issuing the all-gathers of ``prefetch`` while
        its own is in flight (within the limit)."""
        for buffer in unit.buffers:
            self._start_unshard(unit, buffer)
        for target in prefetch:
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
                self._start_unshard(unit, buffer)
        for buffer in unit.buffers:
            buffer.finish_unshard()

    def inflight_all_gathers(self) -> int:
        self._gathers = [b for b in self._gathers if b.is_gathering]
        return len(self._gathers)

    def _start_unshard(self, issuer: "ScheduledUnit", buffer: FlatBuffer) -> None:
        """Issue ``buffer``'s all-gather for ``issuer``'s pre-forward or
        pre-backward (``buffer`` is another unit's when prefetching)."""
        if _issues_all_gather(buffer):
            self.observer.before_all_gather(buffer, issuer.training_state)
        buffer.start_unshard()
        self._track(buffer)

    def _track(self, buffer: FlatBuffer) -> None:
        if buffer.is_gathering and not any(b is buffer for b in self._gathers):
            self._gathers.append(buffer)

    # -------------------------------------------------------- reduce-scatter
    def reduce(self, buffer: FlatBuffer, options: ReduceOptions) -> None:
        """Issue ``buffer``'s reduce-scatter; wait the oldest ones beyond the
        limit."""
        if buffer.grad.is_reducing:  # still in flight from an earlier backward of this step
            self._reduces = deque(b for b in self._reduces if b is not buffer)
        if buffer.grad.has_unreduced:
            self.observer.before_reduce_scatter(buffer)
        if buffer.grad.start_reduce(options):
            self._reduces.append(buffer)
        while len(self._reduces) > self.policy.max_pending_reduces:
            self._reduces.popleft().grad.finish_reduce()

    def finish_reduces(self) -> None:
        while self._reduces:
            self._reduces.popleft().grad.finish_reduce()

    # -------------------------------------------------------------- staging
    def end_iteration(self) -> None:
        """The iteration's last use of unsharded memory is over (end of the
        last backward, or a forward without backward): release the staging
        pool unless the policy retains it between iterations."""
        if not self.policy.retain_staging:
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
