"""Every data collective of the step, from issue to last copy. Buffers
issue nothing; each buffer's :class:`~fsdp_compose.comm.wire.Wire` says
how a collective goes on the wire, called the same way whichever it is.

[Note: the life of a collective]
1. *Issue.* The observer is told first, then the wire issues (a bucket's
   inputs packed).
2. *In flight.* One :class:`InFlight`, kept under each member. Members
   never wait: whoever needs a result asks the queue (``wait_gathers``,
   ``wait_gather``, ``settle``). ``PrefetchPolicy`` bounds the count.
3. *Wait.* The first wait waits the work, copies and frees temporaries,
   then completes members: of an all-gather the one waited for, of a
   reduce-scatter all (replica all-reduce, or fold). Completions are
   queue methods bound once.

[Note: freeing what a collective read]
A backend may hold a finished work's tensors (gloo), so after the wait
their storage is resized to 0: packed tensors, and a lone flat gradient
on the CPU (CUDA frees in stream order); never an output that is its
input (``comm.wire.release_after_collective``).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Container, Literal, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from .._torch_private import profiler_active, unsafe_preserve_version_counter
from ..buffers.flat_buffer import FlatBuffer
from ..buffers.flat_grad import ReduceOptions
from ..buffers.staging import StagingPool
from ..comm.wire import Waitable, all_reduce_replicas, wait_watched
from .tracing import NO_RANGE, profiled
from .buckets import Bucket, BucketPlan
from .model_settings import ModelSettings
from .training_state import TrainingState
from .protocols import BucketedUnit, CollectiveObserver

_BACKWARD = (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)

CollectiveKind = Literal["all_gather", "reduce_scatter", "all_reduce_replicas"]
Completion = Callable[["InFlight", list[FlatBuffer]], None]


class CollectiveEvent(NamedTuple):
    """An entry of :attr:`CollectiveQueue.events`."""

    what: Literal["issue", "complete"]
    kind: CollectiveKind
    buffers: int


class InFlight:
    """One collective issued, not yet waited ([Note: the life of a
    collective])."""

    __slots__ = ("kind", "options", "results", "_pending", "_work", "_process_group", "_copies",
                 "_member_copies", "_packed_output", "_temporaries", "_keep_alive", "_complete",
                 "_settled")

    def __init__(self, kind: CollectiveKind, work: Optional[Waitable],
                 process_group: Optional[dist.ProcessGroup],
                 members: list[FlatBuffer], complete: Completion,
                 copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
                 temporaries: Sequence[torch.Tensor] = (),
                 keep_alive: Sequence[torch.Tensor] = (),
                 member_copies: Sequence[tuple[FlatBuffer, torch.Tensor, torch.Tensor]] = (),
                 packed_output: Optional[torch.Tensor] = None,
                 results: Optional[dict[int, object]] = None,
                 options: ReduceOptions = ReduceOptions()) -> None:
        self.kind: CollectiveKind = kind
        self.results: dict[int, object] = results or {}
        """Per member id: an all-gather's version before it, a reduction's output."""
        self.options: ReduceOptions = options
        self._pending: list[FlatBuffer] = list(members)
        self._work: Optional[Waitable] = work  # None: nothing to wait (one rank)
        self._process_group: Optional[dist.ProcessGroup] = process_group
        self._copies = list(copies)  # (destination, source)
        self._member_copies: dict[int, tuple[FlatBuffer, torch.Tensor, torch.Tensor]] = {
            id(member): (member, destination, source)
            for member, destination, source in member_copies}
        """Made at each member's completion ([Note: a bucket's copies])."""
        self._packed_output = packed_output
        self._temporaries = list(temporaries)
        self._keep_alive = list(keep_alive)  # read by the backend until the wait
        self._complete = complete
        self._settled = False

    @property
    def members(self) -> list[FlatBuffer]:
        return self._pending

    @property
    def done(self) -> bool:
        return not self._pending

    def wait(self, member: Optional[object] = None) -> None:
        """Complete ``member`` (default: all left); on CUDA the host does not block."""
        if not self._settled:
            if self._work is not None:
                wait_watched(self._work, self._process_group)
                self._work = None
            self._process_group = None  # [Note: process groups at exit] in comm/groups.py
            with torch.no_grad():
                for destination, source in self._copies:
                    destination.copy_(source)
            self._copies, self._keep_alive = [], []
            _free(self._temporaries)
            self._temporaries = []
            self._settled = True
        if member is None:
            todo, self._pending = self._pending, []
        else:
            todo = [m for m in self._pending if m is member]
            self._pending = [m for m in self._pending if m is not member]
        if self._member_copies:
            with torch.no_grad():
                for done in todo:
                    entry = self._member_copies.pop(id(done), None)
                    if entry is not None:
                        _, destination, source = entry
                        done.allocate_unsharded()
                        destination.copy_(source)
        if self._packed_output is not None and not self._member_copies:
            _free([self._packed_output])
            self._packed_output = None
        if todo:
            self._complete(self, todo)

    def discard(self) -> None:
        """An iteration raised: wait the work, drop the rest."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._process_group = None
        _free(self._temporaries + ([self._packed_output] if self._packed_output is not None else []))
        self._copies, self._temporaries, self._keep_alive = [], [], []
        self._member_copies, self._packed_output = {}, None
        self._settled = True
        self._pending = []


def _free(tensors: Sequence[torch.Tensor]) -> None:
    """See [Note: freeing what a collective read]."""
    for tensor in tensors:
        tensor.untyped_storage().resize_(0)


class CollectiveQueue:
    """The data collectives of one model, shared by its units."""

    __slots__ = ('buckets', 'events', 'observer', 'settings', 'staging', '_agreed',
                 '_gathered', '_gathering', '_gathers', '_held', '_reduced', '_reduces',
                 '_reducing', '_replica_reduced', '_replicas', '__dict__', '__weakref__')

    def __init__(self, settings: ModelSettings,
                 observer: Optional[CollectiveObserver] = None) -> None:
        self.settings: ModelSettings = settings
        self.buckets: BucketPlan = BucketPlan(settings)
        """Made at the root's pre-forward from the order the ranks agreed (:meth:`order_agreed`)."""
        self.observer: CollectiveObserver = observer or CollectiveObserver()
        self.staging: StagingPool = StagingPool()
        """Unsharded memory reused on the CPU."""
        self._gathers: list[InFlight] = []
        self._gathering: dict[int, InFlight] = {}
        """By buffer id: the all-gather into it in flight."""
        self._reduces: deque[InFlight] = deque()
        self._reducing: dict[int, InFlight] = {}
        """By buffer id: its reduction in flight."""
        self._replicas: deque[list[InFlight]] = deque()
        """Per waited reduce-scatter, its replica all-reduces, oldest first."""
        self._held: dict[int, tuple[Bucket, set[int], ReduceOptions]] = {}
        """Per bucket id: the ids of the buffers whose gradient it still
        expects in this backward."""
        self._agreed: Optional[Sequence[BucketedUnit]] = None
        """The order the last step agreed, for the next step's buckets."""
        self.events: Optional[list[CollectiveEvent]] = None
        """Issues and completions while recording (``None``: off)."""
        self._gathered: Completion = self._gather_done  # bound once
        self._reduced: Completion = self._reduce_done
        self._replica_reduced: Completion = self._replica_done

    def record_events(self, on: bool = True) -> list[CollectiveEvent]:
        """Start (``on=False``: stop) recording :attr:`events`; returns the log."""
        if on:
            self.events = []
            return self.events
        events, self.events = self.events or [], None
        return events

    def _log(self, what: Literal["issue", "complete"], flight: InFlight) -> None:
        """Pre-condition: recording."""
        self.events.append(CollectiveEvent(what, flight.kind, len(flight.results)))

    def share_staging_pool(self, buffers: list[FlatBuffer]) -> None:
        """CPU ``buffers`` use the shared pool."""
        for buffer in buffers:
            if buffer.compute_device.type == "cpu" and not buffer.is_unsharded:
                buffer.staging = self.staging

    # -------------------------------------------------------------- iteration
    def start_iteration(self) -> None:
        """The root's pre-forward: the step's buckets."""
        agreed, self._agreed = self._agreed, None
        self.buckets.refresh(agreed)
        self.observer.start_iteration()

    def order_agreed(self, order: Sequence[BucketedUnit]) -> None:
        """After the fingerprint check passed on every rank: the next step
        buckets ``order``. Verified iterations run unbucketed ([Note: rank divergence])."""
        self._agreed = () if self.observer.will_verify() else tuple(order)

    def end_forward(self) -> None:
        """[Note: the pool across the end of forward] in ``buffers/staging.py``."""
        if not self.settings.prefetch_policy.retain_staging:
            self.staging.release()

    def end_iteration(self) -> None:
        """After the iteration's last use of unsharded memory."""
        self.inflight_all_gathers()
        if self.settings.prefetch_policy.retain_staging:
            self.staging.keep()
        else:
            self.staging.clear()

    def discard_iteration(self) -> None:
        """``reset_iter_state``, after every unit's :meth:`discard_buffer`."""
        self._gathers = []
        self._gathering.clear()
        self._reducing.clear()
        self._reduces.clear()
        self._replicas.clear()
        self._held = {}

    def discard_buffer(self, buffer: FlatBuffer) -> None:
        """An iteration raised: complete its all-gather, drop its reduction."""
        self.wait_gather(buffer)
        flight = self._reducing.pop(id(buffer), None)
        if flight is not None:
            flight.discard()
            for member in flight.members:
                self._reducing.pop(id(member), None)

    # ------------------------------------------------------------- all-gather
    def gather(self, unit: BucketedUnit, prefetch: Sequence[BucketedUnit],
               ran: Container[int]) -> None:
        """Unshard ``unit``, prefetching ``prefetch`` within the limit."""
        if self._gathers:
            self.inflight_all_gathers()
        issuer = unit.training_state
        bucketed = bool(self.buckets.by_unit)
        if not (bucketed and self._gather_bucket(unit, issuer, ran)):
            for buffer in unit.buffers:
                self._gather_alone(buffer, issuer, unit.name)
        for target in prefetch:
            if bucketed and self._gather_bucket(target, issuer, ran, limited=True):
                continue
            for buffer in target.buffers:
                if not _issues_all_gather(buffer):
                    continue
                if self.inflight_all_gathers() >= self.settings.prefetch_policy.max_inflight_all_gathers:
                    break
                self._gather_alone(buffer, issuer, target.name)
        for buffer in unit.buffers:
            if buffer.is_gathering:
                self.wait_gathers(unit)
                return

    def start_unshard(self, unit: BucketedUnit, issuer: TrainingState) -> None:
        """``ShardedModule.unshard``: issue without waiting."""
        for buffer in unit.buffers:
            if _issues_all_gather(buffer):
                while self.inflight_all_gathers() >= self.settings.prefetch_policy.max_inflight_all_gathers:
                    self._gathers[0].wait()
            self._gather_alone(buffer, issuer, unit.name)

    def wait_gathers(self, unit: BucketedUnit) -> None:
        """Post-condition: what was issued for ``unit`` is unsharded."""
        if not any(buffer.is_gathering for buffer in unit.buffers):
            return  # nothing in flight
        with profiled("all_gather_wait", unit.name) if profiler_active() else NO_RANGE:
            for buffer in unit.buffers:
                flight = self._gathering.get(id(buffer))
                if flight is not None:
                    flight.wait(buffer)

    def wait_gather(self, buffer: FlatBuffer) -> None:
        """Before a reshard: complete an unused prefetch into ``buffer``."""
        flight = self._gathering.get(id(buffer))
        if flight is not None:
            flight.wait(buffer)

    def inflight_all_gathers(self) -> int:
        """All-gathers in flight (a bucket's counts one)."""
        if self._gathers:
            self._gathers = [g for g in self._gathers if not g.done]
        return len(self._gathers)

    def _gather_bucket(self, unit: BucketedUnit, issuer: TrainingState, ran: Container[int],
                       limited: bool = False) -> bool:
        """Whether ``unit``'s bucket is gathered as one now (then issued)."""
        bucket = self.buckets.by_unit.get(id(unit))
        if bucket is None:
            return False
        backward = issuer in _BACKWARD
        if not bucket.gathered_in_backward and backward:
            return False  # the first bucket backward reaches (buckets.py)
        if not any(_issues_all_gather(b) for b in unit.buffers):
            return True  # issued with an earlier member (or unsharded): not again per member
        if backward:  # ``unit`` and the members whose use is still ahead
            members = [m for m in bucket.units if m is unit or (
                m.training_state is TrainingState.IDLE and m.backward_possible)]
        else:
            members = [m for m in bucket.units if m is unit or id(m) not in ran]
        wanted = [b for m in members for b in m.buffers if _issues_all_gather(b)]  # ``unit``'s too
        if limited and self.inflight_all_gathers() >= self.settings.prefetch_policy.max_inflight_all_gathers:
            return True
        for buffer in wanted:
            self.observer.before_all_gather(buffer, issuer)
        with profiled("all_gather", "bucket of " + ", ".join(m.name for m in members)) \
                if profiler_active() else NO_RANGE:
            self._issue_packed_gather(bucket.buffers, wanted)
        for buffer in wanted:
            if not buffer.is_gathering and not buffer.is_unsharded:
                self._issue_gather(buffer)  # a kept post-forward piece could not join
        return True

    def _gather_alone(self, buffer: FlatBuffer, issuer: TrainingState, owner: str) -> None:
        """An aliased buffer only switches its views."""
        if buffer.aliased:
            if not buffer.is_unsharded:
                buffer.unshard_in_place()
            return
        if not _issues_all_gather(buffer):
            return
        self.observer.before_all_gather(buffer, issuer)
        with profiled("all_gather", owner) if profiler_active() else NO_RANGE:
            self._issue_gather(buffer)

    def _issue_gather(self, buffer: FlatBuffer) -> None:
        """Over the post-forward group when a piece was kept."""
        prepared = buffer.prepare_unshard()
        if prepared is None:
            return
        shard, group = prepared
        version = buffer.unsharded._version
        wire = buffer.wire if group is buffer.group else buffer.wire.subgroup_gather()
        with unsafe_preserve_version_counter(buffer.unsharded):
            issued = wire.all_gather(buffer.unsharded.detach(), shard, group)
        self._track_gather(InFlight(
            "all_gather", issued.work, issued.process_group, [buffer], self._gathered,
            issued.copies, keep_alive=issued.keep_alive, results={id(buffer): version}))

    def _issue_packed_gather(self, buffers: Sequence[FlatBuffer], wanted: Sequence[FlatBuffer]
                             ) -> None:
        """Fills the members of ``wanted`` that can join ([Note: bucketing])."""
        wanted_ids = {id(b) for b in wanted}
        wire = buffers[0].wire  # one per bucket (the plan's key)
        deferred = wire.fills_members_at_completion  # [Note: a bucket's copies]
        inputs: list[torch.Tensor] = []
        rows: list[Optional[torch.Tensor]] = []
        joined: list[tuple[FlatBuffer, int, int]] = []  # buffer, version, offset
        offset = 0
        world = buffers[0].group.world_size
        for buffer in buffers:
            prepared = buffer.prepare_unshard(coalescable=True, defer_storage=deferred) \
                if id(buffer) in wanted_ids else None
            if prepared is not None:
                joined.append((buffer, buffer.unsharded._version, offset))
                inputs.append(prepared[0])
                rows.append(buffer.unsharded.detach().view(world, -1))
            else:
                inputs.append(buffer.gather_input())
                rows.append(None)
            offset += buffer.layout.shard_numel
        if not joined:
            return
        issued = wire.all_gather_packed(rows, inputs, buffers[0].group)
        grid = issued.grid
        copies = [] if grid is None else [
            (b, b.unsharded.detach().view(world, b.layout.shard_numel),
             grid[:, start:start + b.layout.shard_numel]) for b, _, start in joined]
        self._track_gather(InFlight(
            "all_gather", issued.work, issued.process_group, [b for b, _, _ in joined],
            self._gathered, temporaries=issued.temporaries, keep_alive=issued.keep_alive,
            member_copies=copies, packed_output=grid if issued.grid_is_ours else None,
            results={id(b): version for b, version, _ in joined}))

    def _track_gather(self, flight: InFlight) -> None:
        for buffer in flight.members:
            self._gathering[id(buffer)] = flight
        self._gathers.append(flight)
        if self.events is not None:
            self._log("issue", flight)

    # --------------------------------------------------------- reduce-scatter
    def reduce(self, buffer: FlatBuffer, options: ReduceOptions) -> None:
        """Issue, or hold until the bucket's last expected gradient."""
        bucket = self.buckets.by_buffer.get(id(buffer))
        if bucket is not None:
            held = self._held.get(id(bucket))
            if held is None:  # fixed for this backward: its forward set backward_possible
                expected = {id(b) for u in bucket.units
                            if u.backward_possible and u.settings.requires_gradient_sync
                            for b in u.trainable_buffers}
                held = self._held[id(bucket)] = (bucket, expected, options)
            held[1].discard(id(buffer))
            if not held[1]:
                self._reduce_held(id(bucket), buffer)
            return
        self._issue_reduce([buffer], options, buffer)

    def _reduce_held(self, key: int, trigger: Optional[FlatBuffer] = None) -> None:
        """``trigger`` is observed first, so a divergence names its unit."""
        bucket, _, options = self._held.pop(key)
        reduced = [b for u in bucket.units if u.settings.requires_gradient_sync  # on every rank
                   for b in u.trainable_buffers]
        self._issue_reduce(reduced, options, trigger)

    def flush_held_reduces(self) -> None:
        """End of backward, in plan order."""
        for bucket in self.buckets.buckets:
            if id(bucket) in self._held:
                self._reduce_held(id(bucket))

    def _issue_reduce(self, buffers: list[FlatBuffer], options: ReduceOptions,
                      trigger: Optional[FlatBuffer]) -> None:
        """Its size depends on ``buffers`` only ([Note: bucketing])."""
        for buffer in buffers:
            if buffer.grad.is_reducing:
                self.settle(buffer)  # an earlier backward's
        observed = buffers if trigger is None or trigger is buffers[0] else \
            [trigger] + [b for b in buffers if b is not trigger]
        for buffer in observed:
            if buffer.grad.has_unreduced:
                self.observer.before_reduce_scatter(buffer)
        one = len(buffers) == 1
        with profiled("reduce_scatter", "" if one else f"bucket of {len(buffers)} buffers") \
                if profiler_active() else NO_RANGE:
            flight = self._reduce_scatter_one(buffers[0], options) if one else \
                self._reduce_scatter_bucket(buffers, options)
        if flight is not None:
            for buffer in flight.members:
                self._reducing[id(buffer)] = flight
            self._reduces.append(flight)
            if self.events is not None:
                self._log("issue", flight)
        if self._reduces or self._replicas:
            self._keep_reduce_limit()

    def _reduce_scatter_one(self, buffer: FlatBuffer, options: ReduceOptions
                            ) -> Optional[InFlight]:
        """``None``: no gradient."""
        flat = buffer.grad.take_for_reduce()
        if flat is None:
            return None
        output = _reduce_output(buffer, flat.dtype)
        wire = buffer.wire
        issued = wire.reduce_scatter(output, flat, wire.reduce_group(buffer.group), *options)
        freed = [flat] if flat.device.type == "cpu" else []  # [Note: freeing what a collective read]
        return InFlight("reduce_scatter", issued.work, issued.process_group, [buffer],
                        self._reduced, issued.copies, freed, issued.keep_alive,
                        results={id(buffer): output}, options=options)

    def _reduce_scatter_bucket(self, buffers: list[FlatBuffer], options: ReduceOptions
                               ) -> Optional[InFlight]:
        """Every member carried ([Note: bucketing]); ``None``: no gradient."""
        grads = [b.grad.take_for_reduce() for b in buffers]
        members = [b for b, g in zip(buffers, grads) if g is not None]
        if not members:
            return None
        dtype = next(g.dtype for g in grads if g is not None)
        outputs = [None if g is None else _reduce_output(b, dtype) for b, g in zip(buffers, grads)]
        wire = buffers[0].wire
        issued = wire.reduce_scatter_packed(grads, [b.grad.reduce_chunk for b in buffers], outputs,
                                            wire.reduce_group(buffers[0].group), *options)
        return InFlight("reduce_scatter", issued.work, issued.process_group, members,
                        self._reduced, issued.copies, issued.temporaries, issued.keep_alive,
                        results={id(b): o for b, o in zip(buffers, outputs) if o is not None},
                        options=options)

    def _gather_done(self, flight: InFlight, buffers: list[FlatBuffer]) -> None:
        """Completion of an all-gather."""
        for buffer in buffers:
            del self._gathering[id(buffer)]
            buffer.complete_gather(flight.results[id(buffer)])  # type: ignore[arg-type]
        if self.events is not None and flight.done:
            self._log("complete", flight)

    def _reduce_done(self, flight: InFlight, buffers: list[FlatBuffer]) -> None:
        """Completion of a reduce-scatter: replica all-reduce, else fold."""
        replicas = []
        options = flight.options
        for buffer in buffers:
            del self._reducing[id(buffer)]
            output: torch.Tensor = flight.results[id(buffer)]  # type: ignore[assignment]
            group = buffer.group
            if group.replicate_size > 1 and group.replicate_process_group is not None:
                summed = buffer.wire.replica_input(buffer.grad, output)
                if summed is None:  # kept for a later all-reduce
                    buffer.grad.take_back(output, options, partial=True)
                    continue
                replicas.append(self._all_reduce_replicas(buffer, summed, options))
            else:
                buffer.wire.before_fold(output)
                buffer.grad.take_back(output, options)
        if self.events is not None and flight.done:
            self._log("complete", flight)
        if replicas:
            self._replicas.append(replicas)

    def _replica_done(self, flight: InFlight, buffers: list[FlatBuffer]) -> None:
        """Completion of a replica all-reduce."""
        for buffer in buffers:
            del self._reducing[id(buffer)]
            output: torch.Tensor = flight.results[id(buffer)]  # type: ignore[assignment]
            buffer.wire.before_fold(output)
            buffer.grad.take_back(output, flight.options)
        if self.events is not None and flight.done:
            self._log("complete", flight)

    def _keep_reduce_limit(self) -> None:
        """Wait the oldest beyond the limit."""
        if self._reduces:
            self._reduces = deque(f for f in self._reduces if not f.done)
        while len(self._reduces) > self.settings.prefetch_policy.max_pending_reduces:
            with profiled("reduce_scatter_wait") if profiler_active() else NO_RANGE:
                self._reduces.popleft().wait()
        while len(self._replicas) > self.settings.prefetch_policy.max_pending_reduces:
            with profiled("all_reduce_replicas_wait") if profiler_active() else NO_RANGE:
                for flight in self._replicas.popleft():
                    flight.wait()

    def settle(self, buffer: FlatBuffer) -> None:
        """Post-condition: ``buffer``'s gradient is unpublished, no reduction in flight."""
        flight = self._reducing.get(id(buffer))
        while flight is not None:
            flight.wait()
            if self._reducing.get(id(buffer)) is flight:  # never spin
                del self._reducing[id(buffer)]
            flight = self._reducing.get(id(buffer))

    def make_room_for_reduce(self) -> None:
        """Before a flat gradient is allocated: free room under ``max_pending_reduces``."""
        if not self._reduces:
            return
        self._reduces = deque(f for f in self._reduces if not f.done)
        while len(self._reduces) >= self.settings.prefetch_policy.max_pending_reduces:
            with profiled("reduce_scatter_wait") if profiler_active() else NO_RANGE:
                self._reduces.popleft().wait()

    def all_reduce_held(self, buffer: FlatBuffer, options: ReduceOptions) -> None:
        """The replica all-reduce of what ``set_requires_all_reduce(False)`` kept."""
        group = buffer.group
        if group.replicate_size == 1 or group.replicate_process_group is None:
            return
        partial = buffer.grad.take_partial()
        if partial is not None:
            self._replicas.append([self._all_reduce_replicas(buffer, partial, options)])

    def _all_reduce_replicas(self, buffer: FlatBuffer, summed: torch.Tensor,
                             options: ReduceOptions) -> InFlight:
        group = buffer.group
        work = all_reduce_replicas(summed, group, *options, async_op=True)
        flight = InFlight("all_reduce_replicas", work, group.replicate_process_group, [buffer],
                          self._replica_reduced, results={id(buffer): summed}, options=options)
        self._reducing[id(buffer)] = flight
        if self.events is not None:
            self._log("issue", flight)
        return flight

    def finish_reduces(self) -> None:
        """Oldest first."""
        ranges = profiled("reduce_scatter_wait", "all in flight") if profiler_active() \
            else NO_RANGE
        with ranges:
            while self._reduces:
                self._reduces.popleft().wait()
            while self._replicas:
                for flight in self._replicas.popleft():
                    flight.wait()


def _issues_all_gather(buffer: FlatBuffer) -> bool:
    return not buffer.aliased and not buffer.is_gathering and \
        (not buffer.is_unsharded or buffer.is_stale)


def _reduce_output(buffer: FlatBuffer, dtype: torch.dtype) -> torch.Tensor:
    """The kept sharded gradient where free, else a new tensor."""
    device = buffer.compute_device
    output = buffer.grad.reduce_output(dtype, device)
    if output is None:
        output = torch.empty(buffer.grad.reduce_chunk, dtype=dtype, device=device)
    return output
