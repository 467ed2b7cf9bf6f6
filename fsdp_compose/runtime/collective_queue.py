"""Every data collective of the training step, from issue to last copy:
the one place that all-gathers parameters, reduce-scatters gradients and
all-reduces them over the replicas. The buffers store, view and fold; they
issue nothing. How each collective goes on the wire (exact, quantized, a
user's) is the buffer's :class:`~fsdp_compose.comm.wire.Wire`; the queue
calls it the same way whichever it is.

[Note: the life of a collective]
1. *Issue.* The observer is told first (here and in the end of backward
   only, so "right before every collective it names" holds by
   construction). The wire issues: a bucket's inputs packed into one
   tensor, a lone buffer's used as they are.
2. *In flight.* One :class:`InFlight` per collective, kept by the queue
   under each member it carries; the members know only that they are in
   flight (``FlatBuffer.is_gathering``, ``FlatGradient.is_reducing``) and
   never wait: whoever needs the result first asks the queue
   (``wait_gathers``, ``wait_gather`` before a reshard, ``settle``). The queue bounds how many are in
   flight (``PrefetchPolicy``).
3. *Wait.* The first wait waits the work, makes the copies and frees the
   temporaries, once. It then completes members: of an all-gather, the one
   waited for (a bucket's others at their own unit's wait); of a
   reduce-scatter, all, each issuing its replica all-reduce (of what the
   wire's ``replica_input`` gives: a kept partial sum is added, or the
   output kept) or folding its chunk (the wire's ``before_fold``, then
   ``FlatGradient.fold``). Completions are queue methods bound once; a
   flight carries their data (``InFlight.results``).

[Note: bucketing]
Consecutive small units (``buckets.py``) share one all-gather and one
reduce-scatter. Shards ``s_1 .. s_k`` (``S_i`` elements, one dtype and
group) are packed into ``T = sum S_i``; the all-gather's output is
rank-major, so ``out.view(F, T)[:, off_i:off_i+S_i]`` is buffer ``i``'s
``unsharded.view(F, S_i)``; gradients are packed alike. Every element is
reduced with the same partners in the same order as unbucketed: the
results are bit-identical (``tests/runtime/test_bucketing.py``).

A bucket's collectives always carry *every* member: one already gathered
contributes its shard and receives nothing, one without a gradient
contributes zeros. The plan is the same on every rank, so ranks whose
control flow differs inside a bucket still issue collectives of equal
size; they pair, and the end-of-backward fingerprint names the difference
([Note: rank divergence]).

[Note: a bucket's copies]
A bucket's all-gather fills each member when that member is completed:
its unsharded storage is allocated then and its values copied out of the
packed output, which is freed after the last copy. So at the start of
backward, where activations peak, only the packed output and the members
in use are held. A wire that writes the members itself
(``Wire.fills_members_at_completion`` false: quantized) fills every member
at the wait.

[Note: freeing what a collective read]
A backend may hold a finished work's tensors (gloo, until its worker
thread lets go), so dropping our reference frees nothing at a time we
control. Once the work is waited and the copies made, their storage is
resized to 0 bytes: a bucket's packed tensors on every device, a lone
buffer's flat gradient on the CPU only (CUDA's caching allocator frees in
stream order), never an output that is its input (one rank). The ranks'
small agreement tensors go the same way
(``comm.collectives.release_after_collective``).
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
from ..comm.collectives import all_gather_into, all_reduce_replicas
from ..comm.wire import Waitable
from ..comm.watched_wait import wait_watched
from .tracing import NO_RANGE, profiled
from .buckets import Bucket, BucketPlan
from .model_settings import ModelSettings
from .training_state import TrainingState
from .protocols import BucketedUnit, CollectiveObserver

_BACKWARD = (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)


CollectiveKind = Literal["all_gather", "reduce_scatter", "all_reduce_replicas"]
Completion = Callable[["InFlight", list[FlatBuffer]], None]


class CollectiveEvent(NamedTuple):
    """One entry of :attr:`CollectiveQueue.events`: a collective of
    ``kind`` carrying ``buffers`` flat buffers was issued, or completed (its
    last member)."""

    what: Literal["issue", "complete"]
    kind: CollectiveKind
    buffers: int


class InFlight:
    """One collective issued and not yet waited ([Note: the life of a
    collective]); each member is completed once, by ``complete`` (a
    method of the queue bound once) with the flight and the members done."""

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
        self.options: ReduceOptions = options  # a reduction's
        self._pending: list[FlatBuffer] = list(members)  # not completed yet
        self._work: Optional[Waitable] = work  # None: nothing to wait (one rank)
        self._process_group: Optional[dist.ProcessGroup] = process_group
        self._copies = list(copies)  # (destination, source), made after the wait
        self._member_copies: dict[int, tuple[FlatBuffer, torch.Tensor, torch.Tensor]] = {
            id(member): (member, destination, source)
            for member, destination, source in member_copies}
        """Made at each member's completion ([Note: a bucket's copies])."""
        self._packed_output = packed_output  # what member_copies read: freed after the last
        self._temporaries = list(temporaries)  # freed after the wait's copies
        self._keep_alive = list(keep_alive)  # inputs the backend reads until the wait
        self._complete = complete
        self._settled = False

    @property
    def members(self) -> list[FlatBuffer]:
        return self._pending

    @property
    def done(self) -> bool:
        return not self._pending

    def wait(self, member: Optional[object] = None) -> None:
        """Complete ``member`` (default: every member left). On CUDA the
        wait orders the current stream; the host does not block."""
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
        """An iteration raised: wait the work (it still reads our tensors),
        drop its result and the members."""
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
    """The data collectives of one model ([Note: the life of a
    collective]), shared by its units (``unit.collectives``)."""

    __slots__ = ('buckets', 'events', 'observer', 'settings', 'staging',
                 '_gathered', '_gathering', '_gathers', '_held', '_reduced', '_reduces',
                 '_reducing', '_replica_reduced', '_replicas', '__dict__', '__weakref__')

    def __init__(self, settings: ModelSettings,
                 observer: Optional[CollectiveObserver] = None) -> None:
        self.settings: ModelSettings = settings
        """Read here: ``prefetch_policy``'s limits and ``retain_staging``."""
        self.buckets: BucketPlan = BucketPlan(settings)
        """Rebuilt only where the ranks agree (:meth:`order_agreed`)."""
        self.observer: CollectiveObserver = observer or CollectiveObserver()
        self.staging: StagingPool = StagingPool()
        """Released unsharded memory, reused on the CPU."""
        self._gathers: list[InFlight] = []
        self._gathering: dict[int, InFlight] = {}
        """By buffer id: the all-gather into it in flight."""
        self._reduces: deque[InFlight] = deque()
        self._reducing: dict[int, InFlight] = {}
        """By buffer id: its gradient's reduction in flight (the
        reduce-scatter, then under hybrid sharding the replica all-reduce)."""
        self._replicas: deque[list[InFlight]] = deque()
        """The replica all-reduces of each waited reduce-scatter, oldest first."""
        self._held: dict[int, tuple[Bucket, list[FlatBuffer], ReduceOptions]] = {}
        """Per bucket id: its buffers with a ready gradient, held until
        the last expected one is."""
        self.events: Optional[list[CollectiveEvent]] = None
        """What was issued and completed, in order, while recording
        (:meth:`record_events`; ``None``: off, the default)."""
        self._gathered: Completion = self._gather_done  # bound once: no closure per collective
        self._reduced: Completion = self._reduce_done
        self._replica_reduced: Completion = self._replica_done

    def record_events(self, on: bool = True) -> list[CollectiveEvent]:
        """Start (or with ``on=False`` stop) recording :attr:`events`;
        returns the log, new when starting."""
        if on:
            self.events = []
            return self.events
        events, self.events = self.events or [], None
        return events

    def _log(self, what: Literal["issue", "complete"], flight: InFlight) -> None:
        """Pre-condition: recording (callers check, so nothing is called while off)."""
        self.events.append(CollectiveEvent(what, flight.kind, len(flight.results)))

    def share_staging_pool(self, buffers: list[FlatBuffer]) -> None:
        """CPU ``buffers`` of a unit joining the model use the shared pool."""
        for buffer in buffers:
            if buffer.compute_device.type == "cpu" and not buffer.is_unsharded:
                buffer.staging = self.staging

    # -------------------------------------------------------------- iteration
    def start_iteration(self) -> None:
        """The root's pre-forward."""
        self.buckets.refresh()
        self.observer.start_iteration()

    def order_agreed(self, order: Sequence[BucketedUnit]) -> None:
        """End of the step's last backward, after the fingerprint in
        ``publish_gradients`` showed every rank issued the same collectives
        in the same forward ``order``: rebuild the buckets from it, so the
        plan is the same on every rank. Iterations that verify every
        collective ([Note: rank divergence]) run unbucketed, so their
        checks name the unit whose collective differs."""
        self.buckets.rebuild([] if self.observer.will_verify() else order)

    def end_forward(self) -> None:
        """A backward follows: free the staging pool unless retained
        ([Note: the pool across the end of forward] in ``buffers/staging.py``)."""
        if not self.settings.prefetch_policy.retain_staging:
            self.staging.release()

    def end_iteration(self) -> None:
        """The iteration's last use of unsharded memory is over."""
        self.inflight_all_gathers()  # drops the finished ones
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
        """An iteration raised: complete ``buffer``'s all-gather in flight
        (the unit reshards next), drop its reduction in flight (its
        gradient is discarded next)."""
        self.wait_gather(buffer)
        flight = self._reducing.pop(id(buffer), None)
        if flight is not None:
            flight.discard()
            for member in flight.members:
                self._reducing.pop(id(member), None)

    # ------------------------------------------------------------- all-gather
    def gather(self, unit: BucketedUnit, prefetch: Sequence[BucketedUnit],
               ran: Container[int]) -> None:
        """Unshard ``unit``, issuing ``prefetch``'s all-gathers (within the
        limit) while its own is in flight; a bucket is gathered as one,
        without the members in ``ran`` (forward ran in this pass)."""
        if self._gathers:
            self.inflight_all_gathers()  # forget finished gathers before counting
        issuer = unit.training_state
        bucketed = bool(self.buckets.buckets)  # else no unit is in a bucket: no lookups
        if not (bucketed and self._gather_bucket(unit, issuer, ran)):
            for buffer in unit.buffers:
                self._gather_alone(buffer, issuer, unit.name)
        for target in prefetch:
            if bucketed and self._gather_bucket(target, issuer, ran, limited=True):
                continue
            for buffer in target.buffers:
                if not _issues_all_gather(buffer):
                    continue  # already gathered or in flight
                if self.inflight_all_gathers() >= self.settings.prefetch_policy.max_inflight_all_gathers:
                    break
                self._gather_alone(buffer, issuer, target.name)
        for buffer in unit.buffers:
            if buffer.is_gathering:
                self.wait_gathers(unit)
                return

    def start_unshard(self, unit: BucketedUnit, issuer: TrainingState) -> None:
        """``ShardedModule.unshard``: issue, no wait (at the limit the
        oldest is waited first)."""
        for buffer in unit.buffers:
            if _issues_all_gather(buffer):
                while self.inflight_all_gathers() >= self.settings.prefetch_policy.max_inflight_all_gathers:
                    self._gathers[0].wait()
            self._gather_alone(buffer, issuer, unit.name)

    def wait_gathers(self, unit: BucketedUnit) -> None:
        """Post-condition: what was issued for ``unit`` is unsharded."""
        for buffer in unit.buffers:
            if buffer.is_gathering:
                break
        else:
            return  # nothing in flight (the steady state over one rank, or waited already)
        with profiled("all_gather_wait", unit.name) if profiler_active() else NO_RANGE:
            for buffer in unit.buffers:
                flight = self._gathering.get(id(buffer))
                if flight is not None:  # a bucket's wait completes its other members
                    flight.wait(buffer)

    def wait_gather(self, buffer: FlatBuffer) -> None:
        """Before a reshard: complete an all-gather into ``buffer`` still
        in flight (a prefetch nobody used: the storage is being written)."""
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
        """If ``unit``'s bucket is gathered as one now, issue its all-gather
        (``limited``: within the in-flight limit) and return True."""
        bucket = self.buckets.of_unit(unit)
        if bucket is None:
            return False
        if not bucket.gathered_in_backward and issuer in _BACKWARD:
            return False  # the first bucket backward reaches: member by member (buckets.py)
        members = bucket.gather_members(unit, issuer, ran)
        wanted = [b for m in members for b in m.buffers if _issues_all_gather(b)]
        if not wanted:
            return True  # already gathered or in flight
        if limited and self.inflight_all_gathers() >= self.settings.prefetch_policy.max_inflight_all_gathers:
            return True
        for buffer in wanted:
            self.observer.before_all_gather(buffer, issuer)
        def names() -> str:
            return "bucket of " + ", ".join(m.name for m in members)
        with profiled("all_gather", names) if profiler_active() else NO_RANGE:
            self._issue_packed_gather(bucket.buffers, wanted)
        for buffer in wanted:
            if not buffer.is_gathering and not buffer.is_unsharded:
                self._issue_gather(buffer)  # could not join (kept post-forward piece); observed above
        return True

    def _gather_alone(self, buffer: FlatBuffer, issuer: TrainingState, owner: str) -> None:
        """Issue ``buffer``'s own all-gather where it needs one; an aliased
        buffer (its shard is the unsharded buffer) only switches its views."""
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
        """Into the buffer's unsharded storage, over the post-forward group
        when a piece was kept."""
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
        """One all-gather of every bucket member's shard, filling those of
        ``wanted`` that can join ([Note: bucketing]); the others (a kept
        post-forward piece too) contribute and receive nothing."""
        wanted_ids = {id(b) for b in wanted}
        wire = buffers[0].wire  # the bucket's (the plan's promise)
        deferred = wire.fills_members_at_completion  # see [Note: a bucket's copies]
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
        """Issue ``buffer``'s reduce-scatter, or hold it until its bucket's
        last expected gradient; wait the oldest beyond the limit."""
        bucket = self.buckets.of_buffer(buffer) if self.buckets.buckets else None
        if bucket is not None:
            _, ready, _ = self._held.setdefault(id(bucket), (bucket, [], options))
            if not any(b is buffer for b in ready):
                ready.append(buffer)
            if all(any(b is e for b in ready) for e in bucket.expected_reduces()):
                self._reduce_held(id(bucket), buffer)
            return
        self._issue_reduce([buffer], options, buffer)

    def _reduce_held(self, key: int, trigger: Optional[FlatBuffer] = None) -> None:
        """``trigger``, whose gradient completed the bucket, is observed
        first, so the divergence checks name the unit that made a rank
        reduce the bucket."""
        bucket, _, options = self._held.pop(key)
        self._issue_reduce(bucket.reduced_buffers(), options, trigger)

    def flush_held_reduces(self) -> None:
        """End of backward: reduce what buckets still hold, in plan order
        (the same on every rank)."""
        for bucket in self.buckets.buckets:
            if id(bucket) in self._held:
                self._reduce_held(id(bucket))

    def _issue_reduce(self, buffers: list[FlatBuffer], options: ReduceOptions,
                      trigger: Optional[FlatBuffer]) -> None:
        """Its size depends on ``buffers`` only ([Note: bucketing]);
        nothing is issued when none has a gradient."""
        for buffer in buffers:
            if buffer.grad.is_reducing:
                self.settle(buffer)  # an earlier backward's reduction (set_is_last_backward(False))
        observed = buffers if trigger is None or trigger is buffers[0] else \
            [trigger] + [b for b in buffers if b is not trigger]
        for buffer in observed:
            if buffer.grad.has_unreduced:
                self.observer.before_reduce_scatter(buffer)
        one = len(buffers) == 1  # a bucket of one (the common case): no lists to build
        if profiler_active():
            with profiled("reduce_scatter", "" if one else f"bucket of {len(buffers)} buffers"):
                flight = self._reduce_scatter_one(buffers[0], options) if one else \
                    self._reduce_scatter_bucket(buffers, options)
        else:
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
        """One buffer's reduce-scatter (``None``: no gradient)."""
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
        """A bucket's one reduce-scatter, every member carried ([Note:
        bucketing]; ``None``: no member has a gradient)."""
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
        """Completion of an all-gather (``flight.results``: each buffer's
        version before it)."""
        for buffer in buffers:
            del self._gathering[id(buffer)]
            buffer.complete_gather(flight.results[id(buffer)])  # type: ignore[arg-type]
        if self.events is not None and flight.done:
            self._log("complete", flight)

    def _reduce_done(self, flight: InFlight, buffers: list[FlatBuffer]) -> None:
        """Completion of a reduce-scatter: per member, the replica
        all-reduce of what the wire gives it, else the fold."""
        replicas = []
        options = flight.options
        for buffer in buffers:
            del self._reducing[id(buffer)]
            output: torch.Tensor = flight.results[id(buffer)]  # type: ignore[assignment]
            group = buffer.group
            if group.replicate_size > 1 and group.replicate_process_group is not None:
                summed = buffer.wire.replica_input(buffer.grad, output)
                if summed is None:  # kept for a later reduction's all-reduce
                    buffer.grad.take_back(output, options, partial=True)
                    continue
                work = all_reduce_replicas(summed, group, *options, async_op=True)
                replica = InFlight("all_reduce_replicas", work, group.replicate_process_group,
                                   [buffer], self._replica_reduced,
                                   results={id(buffer): summed}, options=options)
                self._reducing[id(buffer)] = replica
                replicas.append(replica)
                if self.events is not None:
                    self._log("issue", replica)
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
        """Wait the oldest reduce-scatters, then replica all-reduces,
        beyond the limit."""
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
        """Wait ``buffer``'s reduction in flight (and the replica
        all-reduce it issues) to its end: its gradient is unpublished."""
        flight = self._reducing.get(id(buffer))
        while flight is not None:
            flight.wait()
            if self._reducing.get(id(buffer)) is flight:  # completion always moves on; never spin
                del self._reducing[id(buffer)]
            flight = self._reducing.get(id(buffer))

    def make_room_for_reduce(self) -> None:
        """A flat gradient is about to be made: wait the oldest
        reduce-scatters until at most ``max_pending_reduces - 1`` remain, so
        their inputs are freed before it is allocated (as FSDP2 waits the
        previous reduce-scatter at the next reduction)."""
        if not self._reduces:
            return  # nothing in flight (every earlier one waited, or one rank)
        self._reduces = deque(f for f in self._reduces if not f.done)
        while len(self._reduces) >= self.settings.prefetch_policy.max_pending_reduces:
            with profiled("reduce_scatter_wait") if profiler_active() else NO_RANGE:
                self._reduces.popleft().wait()

    def all_reduce_held(self, buffer: FlatBuffer, options: ReduceOptions) -> None:
        """Issue the replica all-reduce of what ``set_requires_all_reduce(False)``
        kept for ``buffer`` (``module_methods/manual_finalization.py``); its
        completion folds it. Nothing kept: nothing issued."""
        group = buffer.group
        if group.replicate_size == 1 or group.replicate_process_group is None:
            return  # no replicas: nothing is ever kept partial
        partial = buffer.grad.take_partial()
        if partial is None:
            return
        work = all_reduce_replicas(partial, group, *options, async_op=True)
        flight = InFlight("all_reduce_replicas", work, group.replicate_process_group, [buffer],
                          self._replica_reduced, results={id(buffer): partial}, options=options)
        self._reducing[id(buffer)] = flight
        self._replicas.append([flight])
        if self.events is not None:
            self._log("issue", flight)

    def finish_reduces(self) -> None:
        """Oldest first."""
        ranges = profiled("reduce_scatter_wait", "all in flight") if profiler_active() \
            else NO_RANGE
        with ranges:
            while self._reduces:
                self._reduces.popleft().wait()  # may add replica all-reduces
            while self._replicas:
                for flight in self._replicas.popleft():
                    flight.wait()


def gather_values(buffer: FlatBuffer) -> torch.Tensor:
    """``buffer``'s padded flat values. Blocking, not observed: for
    initialisation and ``full_params`` between steps."""
    full = torch.empty(buffer.layout.padded_numel, dtype=buffer.dtype,
                       device=buffer.compute_device)
    all_gather_into(full, buffer.sharded.to(buffer.compute_device), buffer.group)
    return full


def _issues_all_gather(buffer: FlatBuffer) -> bool:
    return not buffer.aliased and not buffer.is_gathering and \
        (not buffer.is_unsharded or buffer.is_stale)


def _reduce_output(buffer: FlatBuffer, dtype: torch.dtype) -> torch.Tensor:
    """The kept sharded gradient where free ([Note: the kept sharded
    gradient]), else a new tensor."""
    device = buffer.compute_device
    output = buffer.grad.reduce_output(dtype, device)
    if output is None:
        output = torch.empty(buffer.grad.reduce_chunk, dtype=dtype, device=device)
    return output
