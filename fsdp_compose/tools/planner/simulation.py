"""One training step of the library's schedule, replayed on byte counts
([Note: the simulated step]).
``tests/tools/test_planner.py`` checks it against the profiler on 2 gloo ranks.

[Note: the simulated step]
A step is a list of moments in the library's order (``runtime/prefetch_order.py``,
``runtime/collective_queue.py``, ``runtime/unit.py``, ``buffers/flat_grad.py``); ``total_peak`` is the largest. Forward of
unit i: the root (unsharded until its backward unless
reshard_after_forward=True) and the kept units before i (the split root's
parts), unit i and the next ``prefetch`` units (in flight). Backward of
unit i, in reverse order: the root, the kept units before i, unit i and
the next ``prefetch`` units in backward order, and then
  (a) unit i's per-parameter gradients (the root's pile up from the start
      of backward: its head runs last in forward; those of its modules
      before the first unit, the embeddings, only at its own backward) and
      the padded flat gradient the split's backward concatenates them
      into, both alive for a moment (plus a copy when reduce_dtype differs);
  (b) its reduce-scatter (max_pending_reduces=1): the previous unit's,
      in flight through this unit's backward, is waited once this unit's
      per-parameter gradients exist, before they are concatenated
      (``CollectiveQueue.make_room_for_reduce``), so one flat gradient is
      being reduced at a time. The output is this rank's gradient shard,
      extra only when its dtype or device differs.
Buckets ([Note: bucketing] in ``runtime/collective_queue.py``; which units:
``buckets.py``): a unit's all-gather is its bucket's, issued for all
members at once (fixed-size: every member, in forward and in backward) and
counted as one against the prefetch; it holds the packed shards (T) until
its first wait and the output (F*T) until its last member waits (each
member's unsharded buffer is filled at its own wait, [Note: a bucket's
copies]; a lone unit's at issue). In backward the last bucket's members,
the first reached, are gathered as lone units. A member's flat gradient is held until the bucket's last member
in backward (its first in forward); then all of them are packed (F*T) and
reduced into a chunk (T) and the members' outputs, alive with the packed
gradients until the reduce-scatter is waited.
A unit's assembled copies ([Note: assembled copies] in
``buffers/param_views.py``) count while it is unsharded: beside the buffer
where other parameters are read in place, and as the buffer itself where
every parameter is copied (its gathered values are released once copied).
Gradient shards exist from their reduce-scatter to the optimizer step
(``zero_grad(set_to_none=True)`` frees them); the step adds the optimizer's
temporaries. A unit's saved activations live from its forward to its
backward; the root's, by where they were saved between the units.
With ``backend="gloo"`` (CPU): each all-gather in flight stages a copy of
its output; a reduce-scatter is an in-place all-reduce (no copy; with
``set_gloo_reduce_scatter_via_all_reduce(False)`` gloo's reduce-scatter
clones its input until the work is released); the unsharded memory of
resharded units stays in the staging pool (``buffers/staging.py``; off on torch
2.11, ``Step.pooling``) until the
iteration's last all-gather of a buffer of its size, so until then each size
counts at its high-water mark so far, and after it as the buffers of that
size still unsharded ([Note: releasing what no fill will take]). Not estimated: gloo
sometimes keeps the clones of finished reduce-scatters (with buckets: the
packed gradients and reduced chunk) alive into the next
step (none to three whole unit-sized copies per rank at the peak, varying
by rank and run, in ``tests/tools/test_planner.py``'s runs; not a Python cycle).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Optional

import torch.nn as nn

from ...setup.units import plan_buffers
from ...buffers.layout import FlatLayout
from ...buffers.param_views import ViewPlan
from ...buffers.records import apply_dtype_overrides, buffer_policy, is_aliased
from ...comm.collectives import gloo_reduce_scatter_via_all_reduce
from ...policies import CPUOffloadPolicy, MixedPrecisionPolicy
from ...runtime.state import ROOT_LABEL
from .buckets import BucketKey, unit_key
from .report import MemoryEstimate, PeakParts
from .units import UnitSpec


class UnitPlan(NamedTuple):
    """Bytes of one unit on rank 0 (see [Note: the simulated step])."""

    name: str
    sharded: int
    grads: int  # gradient shards (trainable buffers)
    state: int  # one optimizer state tensor per trainable element on the most loaded rank
    trainable_params: int
    unsharded: tuple[int, ...]  # per buffer, compute dtype
    copies: int  # assembled copies kept beside a buffer that others read in place
    view_grads: int  # per-parameter gradients before the split's backward
    flat_grad: int  # the split's output, compute dtype
    flat_reduce: int  # the reduce-scatter input, reduce dtype
    reduce_extra: int  # reduce-scatter outputs that are not the gradient shard
    shard_copy: int  # the cast/moved shard an all-gather reads
    largest_slice: int  # bytes of the largest parameter slice a rank owns
    shard_compute: int  # the shards in compute dtype: a bucketed all-gather's packed input
    reduce_shard: int  # this rank's chunk of the reduce-scatter (0 on one rank)
    bucket_key: BucketKey  # runtime/buckets.py's key (None: never bucketed)


class _Buffer(NamedTuple):
    layout: FlatLayout
    size: int  # element sizes: parameters, compute (all-gather), reduce-scatter
    compute: int
    reduce: int
    params: list[nn.Parameter]
    extra_output: bool  # the reduce-scatter output is not the gradient shard
    shard_copy: bool  # the all-gather reads a cast/moved copy of the shard
    aliased: bool  # one rank: the unsharded buffer is the shard itself
    copies: int  # elements assembled beside the unsharded buffer (see _copied_beside)


def _copied_beside(layout: FlatLayout) -> int:
    """Elements of the assembled copies ([Note: assembled copies] in
    ``buffers/param_views.py``) held *in addition to* the unsharded buffer
    while it is unsharded: the parameters that are not one contiguous
    range of it, when some others are (a buffer read only through copies
    releases its gathered values once they are filled, so it holds about
    the buffer's size either way, which ``unsharded`` counts)."""
    views = ViewPlan(layout, layout.moved_dims())
    return 0 if views.copies_only else views.copy_numel


def plan_unit(spec: UnitSpec, world: int, mp: MixedPrecisionPolicy, offload: bool) -> UnitPlan:
    """The bytes of ``spec``'s flat buffers on rank 0, laid out and typed by
    ``fully_shard``'s own ``setup/units.plan_buffers``."""
    policy = buffer_policy(mp, CPUOffloadPolicy() if offload else None, cuda_available=False)
    buffers, train, compute, reduce_comm = [], [], [], []
    apply_dtype_overrides(spec.records, mp)  # as fully_shard: per parameter, before grouping
    for plan in plan_buffers(spec.records, world, policy):
        dtypes = plan.dtypes
        compute.append(dtypes.compute)
        if plan.requires_grad:
            reduce_comm.append(dtypes.reduce_comm)
        # the reduce-scatter moves reduce_comm (one rank: nothing moves, no cast)
        reduce = dtypes.reduce_comm if world > 1 else dtypes.reduce
        b = _Buffer(plan.layout, dtypes.param.itemsize, dtypes.compute.itemsize, reduce.itemsize,
                    [r.param for r in plan.records], offload or reduce != dtypes.param,
                    offload or dtypes.compute != dtypes.param and world > 1,
                    is_aliased(world, dtypes, stored_where_computed=not offload),
                    _copied_beside(plan.layout))
        buffers.append(b)
        if plan.requires_grad:
            train.append(b)
    return UnitPlan(
        name=spec.name,
        sharded=sum(b.layout.shard_numel * b.size for b in buffers),
        grads=sum(b.layout.shard_numel * b.size for b in train),
        # the most loaded rank's parameter elements (padding has no state)
        state=sum(max(b.layout.rank_numels()) * b.size for b in train),
        trainable_params=sum(len(b.params) for b in train),
        unsharded=tuple(0 if b.aliased else b.layout.padded_numel * b.compute for b in buffers),
        copies=sum(b.copies * b.compute for b in buffers if not b.aliased),
        view_grads=sum(b.layout.numel * b.compute for b in train),
        flat_grad=sum(b.layout.padded_numel * b.compute for b in train),
        # one rank: the flat gradient itself becomes the gradient shard
        flat_reduce=0 if world == 1 else sum(b.layout.padded_numel * b.reduce for b in train),
        reduce_extra=sum(b.layout.shard_numel * b.reduce for b in train if b.extra_output),
        shard_copy=sum(b.layout.shard_numel * b.compute for b in buffers if b.shard_copy),
        largest_slice=max((min(p.numel(), b.layout.shard_numel) * b.size
                           for b in train for p in b.params), default=0),
        shard_compute=sum(b.layout.shard_numel * b.compute for b in buffers),
        reduce_shard=0 if world == 1 else sum(b.layout.shard_numel * b.reduce for b in train),
        bucket_key=unit_key(compute, reduce_comm, any(b.aliased for b in buffers), offload))


class _Moment(NamedTuple):
    label: str
    live: frozenset  # plan indices whose parameters are unsharded
    transient: int  # other working-set bytes
    comm: int
    reduced: frozenset  # plan indices whose gradient shard exists
    acts: int


@dataclass
class Step:
    """One training step (see [Note: the simulated step]); plans in forward
    order, the root first."""

    plans: list[UnitPlan]
    unit_acts: list[int]
    root_acts: list[int]  # by position: after that many units started
    moments: int
    adam: bool
    offload: bool
    pool: bool  # the CPU staging pool keeps unsharded memory
    staging: bool  # gloo copies what it communicates
    prefetch: int
    reshard_after_forward: Optional[bool]
    buckets: list[list[int]] = field(default_factory=list)  # plan indices sharing collectives
    kept: frozenset = frozenset()  # plan indices kept from forward to backward (split root)
    pooling: bool = True  # pool on: this torch can lend storages memory (CAN_SWAP_STORAGE_DATA)
    root_late_grads: int = 0  # root parameter gradients that arrive at its own backward only
    keep_unsharded: bool = False  # set_keep_unsharded_storage: every unsharded buffer held always

    def estimate(self, world: int, backend: str, activations: Optional[int],
                 backend_assumed: bool = False, bucket_cap_mb: float = 0.0) -> MemoryEstimate:
        plans = self.plans
        sharded = sum(p.sharded for p in plans)
        grads = sum(p.grads for p in plans)
        state = self.moments * sum(p.state for p in plans)
        state += 4 * sum(p.trainable_params for p in plans) if self.adam else 0
        fixed = 0 if self.offload else sharded + state
        moments = list(self._moments())
        pooled = self._pooled(moments) if self.pool and self.pooling else None
        parts = []
        kept = sum(sum(p.unsharded) for p in plans) if self.keep_unsharded else 0  # aliased: 0
        for index, m in enumerate(moments):
            unsharded = pooled[index] if pooled is not None else \
                sum(sum(plans[i].unsharded) for i in m.live)
            if self.keep_unsharded:  # held at every moment, in use or not (no pool)
                unsharded = kept
            unsharded += sum(plans[i].copies for i in m.live)  # not pooled: resized in place
            shard_grads = 0 if self.offload else sum(plans[i].grads for i in m.reduced)
            parts.append(PeakParts(fixed, shard_grads, unsharded + m.transient, m.comm, m.acts))
        peak = max(range(len(parts)), key=lambda i: sum(parts[i]))
        largest = max(plans, key=lambda p: sum(p.unsharded))
        return MemoryEstimate(
            world_size=world, backend=backend, num_units=len(plans), sharded_params=sharded,
            grads=grads, optimizer_state=state, persistent=sharded + grads + state,
            transient_unsharded_peak=max(p.working_set for p in parts),
            comm_staging=max(p.comm_staging for p in parts), activations=activations,
            state_peak=max(sum(p[:3]) for p in parts),
            total_peak=sum(parts[peak]), peak_at=moments[peak].label, peak_parts=parts[peak],
            cpu_bytes=sharded + grads + state if self.offload else 0,
            largest_unit=largest.name, largest_unit_bytes=sum(largest.unsharded),
            backend_assumed=backend_assumed, bucket_cap_mb=bucket_cap_mb,
            buckets=tuple(tuple(plans[i].name for i in b) for b in self.buckets),
            kept_unsharded=kept)

    def _groups(self, backward: bool = False) -> list[list[int]]:
        """Per plan index, the units gathered and reduced with it: its
        bucket, else itself alone (``backward``: the units gathered with it
        in backward, where the last bucket's members are gathered alone,
        ``runtime/buckets.py``)."""
        groups = [[i] for i in range(len(self.plans))]
        for bucket in self.buckets[:-1] if backward else self.buckets:
            for i in bucket:
                groups[i] = bucket
        return groups

    def _gathering(self, groups: list[list[int]]) -> tuple[int, int]:
        """(working set, gloo staging) of the all-gathers of ``groups`` in
        flight, beyond the unsharded buffers they fill: cast shard copies; a
        bucket's packed input (T) and output (F*T) (see [Note: bucketing]
        in ``runtime/collective_queue.py``); gloo's copy of the output."""
        plans, transient, comm = self.plans, 0, 0
        for group in groups:
            transient += sum(plans[j].shard_copy for j in group)
            if len(group) > 1:
                transient += sum(plans[j].shard_compute + sum(plans[j].unsharded) for j in group)
            comm += sum(sum(plans[j].unsharded) for j in group) if self.staging else 0
        return transient, comm

    def _packed(self, group: list[int]) -> int:
        """A bucket's packed output (F*T), alive after its all-gather's
        first wait until its last member waits (0 for a lone unit)."""
        if len(group) == 1:
            return 0
        return sum(sum(self.plans[j].unsharded) for j in group)

    def _reducing(self, group: list[int]) -> int:
        """What ``group``'s reduce-scatter keeps alive while in flight: the
        flat gradient (a bucket: the packed gradients, F*T, and the reduced
        chunk, T) and outputs that are not the gradient shard."""
        plans = self.plans
        extra = sum(plans[j].reduce_extra for j in group)
        if len(group) == 1:
            return plans[group[0]].flat_reduce + extra
        return sum(plans[j].flat_reduce + plans[j].reduce_shard for j in group) + extra

    def _moments(self) -> Iterator[_Moment]:
        plans, k, n = self.plans, self.prefetch, len(self.plans)
        # gloo's reduce-scatter clones its input; the in-place all-reduce that
        # replaces it by default does not (see [Note: gloo reduce-scatter as an
        # all-reduce] in comm/collectives.py)
        gloo_reduce_copy = self.staging and not gloo_reduce_scatter_via_all_reduce()
        raf = self.reshard_after_forward
        kept = set(range(n)) if raf is False else \
            set(self.kept) | ({0} if raf is not True else set())  # the root, the split parts
        groups = self._groups()
        # backward gathers the first bucket it reaches (the last) member by member
        gathered = self._groups(backward=True)

        def acts(i: int, own: bool) -> int:  # root's saved before unit i, units 1..i
            return sum(self.root_acts[:i]) + sum(self.unit_acts[1:i + own])

        def distinct(gs: list[list[int]]) -> list[list[int]]:
            return list({g[0]: g for g in gs}.values())

        none = frozenset()
        for i in range(n):  # forward
            targets = range(i + 1, min(i + k, n - 1) + 1)
            # prefetched lone units are filled at issue, a bucket's members at their wait
            ahead = {t for t in targets if len(groups[t]) == 1}
            # in flight: unit i's own all-gather (a bucket's: at its first member)
            # and those of the prefetch targets (a bucket counts as one)
            first = groups[i][0] == i
            flying = distinct(([groups[i]] if first else [])
                              + [groups[t] for t in targets if groups[t] is not groups[i]])
            transient, comm = self._gathering(flying)
            if not first:
                transient += self._packed(groups[i])  # until its last member's copy
            live = {i} | ahead | {j for j in kept if j < i}
            yield _Moment(_label("forward", plans[i], "all-gather"), frozenset(live),
                          transient, comm, none, acts(i, True))
        yield _Moment("end of forward", frozenset(kept), 0, 0, none,
                      sum(self.root_acts) + sum(self.unit_acts))
        reduced: set[int] = set()
        pending: Optional[list[int]] = None  # the units whose reduce-scatter is in flight
        for i in range(n - 1, -1, -1):  # backward
            p, group = plans[i], groups[i]
            targets = range(max(i - k, 1), i)
            ahead = {t for t in targets if len(gathered[t]) == 1}
            live = frozenset({0, i} | ahead | {j for j in kept if j < i})
            # the bucket's packed output lives until its last member (group[0]) waits
            packed = self._packed(gathered[i])
            flying = 0 if pending is None else self._reducing(pending)
            # the root's parameter gradients, but for those of its modules before the units
            held = flying + (plans[0].view_grads - self.root_late_grads if i else 0)
            # a bucket's flat gradients wait for its last member's backward
            held += sum(plans[j].flat_grad for j in group if j > i)
            comm = flying if gloo_reduce_copy else 0
            # the prefetched all-gathers' shard copies (a bucket's packed input
            # and output too) stay until their first unit's backward waits
            gathering, staged = self._gathering(
                distinct([gathered[t] for t in targets if gathered[t] is not gathered[i]]))
            held += gathering
            yield _Moment(_label("backward", p, "start"), live, held + packed,
                          comm + staged, frozenset(reduced), acts(i, True))
            if gathered[i][0] != i:
                held += packed  # through this unit's backward
            if not p.flat_grad:
                continue  # frozen only: no gradient, no reduce-scatter
            cast = p.flat_reduce if p.flat_reduce != p.flat_grad else 0
            if pending is not None:
                # the per-parameter gradients exist; the reduction in flight is
                # waited (its input freed) before they are concatenated
                yield _Moment(_label("backward", p, "gradients computed"), live,
                              held + p.view_grads, comm, frozenset(reduced), acts(i, False))
                reduced.update(pending)
                pending, held, comm = None, held - flying, 0
            yield _Moment(_label("backward", p, "gradients"), live,
                          held + p.view_grads + p.flat_grad + cast, comm,
                          frozenset(reduced), acts(i, False))
            if group[0] != i:
                continue  # held for the bucket's last member (its first in forward)
            reduced.update(j for j in group if not plans[j].reduce_extra)  # outputs are the shards
            if len(group) == 1:
                issued = p.flat_reduce + p.reduce_extra
                label = "reduce-scatter"
            else:  # taken flat gradients (reduce dtype), packed, reduced chunk, outputs
                held -= sum(plans[j].flat_grad for j in group if j > i)
                issued = sum(plans[j].flat_reduce for j in group) + self._reducing(group)
                label = f"bucket reduce-scatter ({len(group)} units)"
            clone = sum(plans[j].flat_reduce for j in group) if gloo_reduce_copy else 0
            yield _Moment(_label("backward", p, label), live, held + issued, comm + clone,
                          frozenset(reduced), acts(i, False))
            pending = group
        temp = 0
        if self.adam and not self.offload:  # sqrt and division temporaries of the update
            temp = 2 * max(p.largest_slice for p in plans) if self.pool else \
                sum(p.grads for p in plans)  # CPU: per parameter; CUDA: foreach, whole shards
        yield _Moment("optimizer step", none, temp, 0, frozenset(range(n)), 0)

    def _pooled(self, moments: list[_Moment]) -> list[int]:
        """Unsharded memory at each moment with the CPU staging pool: per
        buffer size, the most buffers of that size unsharded at once so far,
        until the moment of the last all-gather of that size (a buffer
        becoming live); from then on, those still unsharded."""
        counts: list[dict[int, int]] = []
        for m in moments:
            count: dict[int, int] = {}
            for i in m.live:
                for size in self.plans[i].unsharded:
                    count[size] = count.get(size, 0) + 1
            counts.append(count)
        last_fill: dict[int, int] = {}
        previous: frozenset[int] = frozenset()
        for index, m in enumerate(moments):
            for i in m.live - previous:
                for size in self.plans[i].unsharded:
                    last_fill[size] = index
            previous = m.live
        most: dict[int, int] = {}
        out = []
        for index, count in enumerate(counts):
            for size, c in count.items():
                most[size] = max(most.get(size, 0), c)
            out.append(sum(size * (most[size] if index < last_fill.get(size, -1) else
                                   count.get(size, 0)) for size in most))
        return out


def _label(phase: str, plan: UnitPlan, what: str) -> str:
    return f"{phase} of {plan.name if plan.name == ROOT_LABEL else repr(plan.name)}: {what}"
