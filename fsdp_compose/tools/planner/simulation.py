"""One training step of the library's schedule, replayed on byte counts.

[Note: the simulated step]
A step is a list of moments in the library's order; ``total_peak`` is the
largest. Forward of unit i holds the root, the kept units, unit i and the
next ``prefetch`` units; backward, in reverse, the same plus unit i's
per-parameter and flat gradients and one reduce-scatter in flight. A bucket
([Note: bucketing]) is gathered at once and counts as one prefetch; in
backward the first bucket reached is gathered unit by unit. Assembled
copies ([Note: assembled copies]) count while their unit is unsharded,
gradient shards from their reduce-scatter on, activations from a unit's
forward to its backward. Under gloo each all-gather in flight stages a copy
of its output, and the staging pool keeps each unsharded size at its
high-water mark until its last all-gather ([Note: releasing what no fill
will take]). Not estimated: clones gloo sometimes keeps into the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Optional

import torch.nn as nn

from ...setup.units import plan_buffers
from ...buffers.layout import FlatLayout
from ...buffers.param_views import ViewPlan
from ...buffers.records import apply_dtype_overrides, buffer_policy, is_aliased
from ...comm.wire import gloo_reduce_scatter_via_all_reduce
from ...policies import CPUOffloadPolicy, MixedPrecisionPolicy
from ...runtime.state import ROOT_LABEL
from .buckets import BucketKey, unit_key
from .report import MemoryEstimate, PeakParts
from .units import UnitSpec


class UnitPlan(NamedTuple):
    """Bytes of one unit on rank 0."""

    name: str
    sharded: int
    grads: int
    state: int  # one state tensor per trainable element, most loaded rank
    trainable_params: int
    unsharded: tuple[int, ...]  # per buffer, compute dtype
    copies: int  # assembled copies beside a buffer read in place
    view_grads: int  # per-parameter gradients
    flat_grad: int  # compute dtype
    flat_reduce: int  # reduce dtype
    reduce_extra: int  # reduce-scatter outputs that are not the shard
    shard_copy: int  # the cast/moved shard an all-gather reads
    largest_slice: int  # the largest parameter slice a rank owns
    shard_compute: int  # a bucketed all-gather's packed input
    reduce_shard: int  # 0 on one rank
    bucket_key: BucketKey  # None: never bucketed


class _Buffer(NamedTuple):
    layout: FlatLayout
    size: int  # parameters, compute, reduce-scatter
    compute: int
    reduce: int
    params: list[nn.Parameter]
    extra_output: bool
    shard_copy: bool
    aliased: bool  # one rank: the unsharded buffer is the shard itself
    copies: int


def _copied_beside(layout: FlatLayout) -> int:
    """Elements of the assembled copies held beside the unsharded buffer (0
    where the buffer is read only through copies: it is released)."""
    views = ViewPlan(layout, layout.moved_dims())
    return 0 if views.copies_only else views.copy_numel


def plan_unit(spec: UnitSpec, world: int, mp: MixedPrecisionPolicy, offload: bool) -> UnitPlan:
    """The bytes of ``spec``'s flat buffers on rank 0, laid out by
    ``setup/units.plan_buffers`` as ``fully_shard`` does."""
    policy = buffer_policy(mp, CPUOffloadPolicy() if offload else None, cuda_available=False)
    buffers, train, compute, reduce_comm = [], [], [], []
    apply_dtype_overrides(spec.records, mp)  # before grouping, as fully_shard
    for plan in plan_buffers(spec.records, world, policy):
        dtypes = plan.dtypes
        compute.append(dtypes.compute)
        if plan.requires_grad:
            reduce_comm.append(dtypes.reduce_comm)
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
    live: frozenset  # plan indices unsharded
    transient: int  # other working-set bytes
    comm: int
    reduced: frozenset  # plan indices whose shard exists
    acts: int


@dataclass
class Step:
    """One training step ([Note: the simulated step]); plans in forward order,
    the root first."""

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
    buckets: list[list[int]] = field(default_factory=list)
    kept: frozenset = frozenset()  # split root parts
    pooling: bool = True  # CAN_SWAP_STORAGE_DATA
    root_late_grads: int = 0  # root gradients arriving at its own backward only
    keep_unsharded: bool = False  # every unsharded buffer held always

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
        kept = sum(sum(p.unsharded) for p in plans) if self.keep_unsharded else 0
        for index, m in enumerate(moments):
            unsharded = pooled[index] if pooled is not None else \
                sum(sum(plans[i].unsharded) for i in m.live)
            if self.keep_unsharded:  # held in use or not (no pool)
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
        """Per plan index, the units gathered and reduced with it (``backward``:
        the last bucket's members alone)."""
        groups = [[i] for i in range(len(self.plans))]
        for bucket in self.buckets[:-1] if backward else self.buckets:
            for i in bucket:
                groups[i] = bucket
        return groups

    def _gathering(self, groups: list[list[int]]) -> tuple[int, int]:
        """(working set, gloo staging) of the all-gathers of ``groups`` in flight,
        beyond the unsharded buffers."""
        plans, transient, comm = self.plans, 0, 0
        for group in groups:
            transient += sum(plans[j].shard_copy for j in group)
            if len(group) > 1:
                transient += sum(plans[j].shard_compute + sum(plans[j].unsharded) for j in group)
            comm += sum(sum(plans[j].unsharded) for j in group) if self.staging else 0
        return transient, comm

    def _packed(self, group: list[int]) -> int:
        """A bucket's packed output (0 alone)."""
        if len(group) == 1:
            return 0
        return sum(sum(self.plans[j].unsharded) for j in group)

    def _reducing(self, group: list[int]) -> int:
        """What ``group``'s reduce-scatter keeps alive in flight."""
        plans = self.plans
        extra = sum(plans[j].reduce_extra for j in group)
        if len(group) == 1:
            return plans[group[0]].flat_reduce + extra
        return sum(plans[j].flat_reduce + plans[j].reduce_shard for j in group) + extra

    def _moments(self) -> Iterator[_Moment]:
        plans, k, n = self.plans, self.prefetch, len(self.plans)
        # gloo's reduce-scatter clones its input; the default all-reduce does not
        gloo_reduce_copy = self.staging and not gloo_reduce_scatter_via_all_reduce()
        raf = self.reshard_after_forward
        kept = set(range(n)) if raf is False else \
            set(self.kept) | ({0} if raf is not True else set())
        groups = self._groups()
        # backward gathers the first bucket it reaches member by member
        gathered = self._groups(backward=True)

        def acts(i: int, own: bool) -> int:
            return sum(self.root_acts[:i]) + sum(self.unit_acts[1:i + own])

        def distinct(gs: list[list[int]]) -> list[list[int]]:
            return list({g[0]: g for g in gs}.values())

        none = frozenset()
        for i in range(n):  # forward
            targets = range(i + 1, min(i + k, n - 1) + 1)
            ahead = {t for t in targets if len(groups[t]) == 1}
            # in flight: unit i's all-gather and the targets' (a bucket once)
            first = groups[i][0] == i
            flying = distinct(([groups[i]] if first else [])
                              + [groups[t] for t in targets if groups[t] is not groups[i]])
            transient, comm = self._gathering(flying)
            if not first:
                transient += self._packed(groups[i])
            live = {i} | ahead | {j for j in kept if j < i}
            yield _Moment(_label("forward", plans[i], "all-gather"), frozenset(live),
                          transient, comm, none, acts(i, True))
        yield _Moment("end of forward", frozenset(kept), 0, 0, none,
                      sum(self.root_acts) + sum(self.unit_acts))
        reduced: set[int] = set()
        pending: Optional[list[int]] = None  # reduce-scatter in flight
        for i in range(n - 1, -1, -1):  # backward
            p, group = plans[i], groups[i]
            targets = range(max(i - k, 1), i)
            ahead = {t for t in targets if len(gathered[t]) == 1}
            live = frozenset({0, i} | ahead | {j for j in kept if j < i})
            packed = self._packed(gathered[i])
            flying = 0 if pending is None else self._reducing(pending)
            held = flying + (plans[0].view_grads - self.root_late_grads if i else 0)
            held += sum(plans[j].flat_grad for j in group if j > i)
            comm = flying if gloo_reduce_copy else 0
            # prefetched copies stay until their first unit's backward waits
            gathering, staged = self._gathering(
                distinct([gathered[t] for t in targets if gathered[t] is not gathered[i]]))
            held += gathering
            yield _Moment(_label("backward", p, "start"), live, held + packed,
                          comm + staged, frozenset(reduced), acts(i, True))
            if gathered[i][0] != i:
                held += packed
            if not p.flat_grad:
                continue  # frozen only: no gradient, no reduce-scatter
            cast = p.flat_reduce if p.flat_reduce != p.flat_grad else 0
            if pending is not None:
                # the reduction in flight is waited before concatenating
                yield _Moment(_label("backward", p, "gradients computed"), live,
                              held + p.view_grads, comm, frozenset(reduced), acts(i, False))
                reduced.update(pending)
                pending, held, comm = None, held - flying, 0
            yield _Moment(_label("backward", p, "gradients"), live,
                          held + p.view_grads + p.flat_grad + cast, comm,
                          frozenset(reduced), acts(i, False))
            if group[0] != i:
                continue  # held for the bucket's last member (its first in forward)
            reduced.update(j for j in group if not plans[j].reduce_extra)
            if len(group) == 1:
                issued = p.flat_reduce + p.reduce_extra
                label = "reduce-scatter"
            else:
                held -= sum(plans[j].flat_grad for j in group if j > i)
                issued = sum(plans[j].flat_reduce for j in group) + self._reducing(group)
                label = f"bucket reduce-scatter ({len(group)} units)"
            clone = sum(plans[j].flat_reduce for j in group) if gloo_reduce_copy else 0
            yield _Moment(_label("backward", p, label), live, held + issued, comm + clone,
                          frozenset(reduced), acts(i, False))
            pending = group
        temp = 0
        if self.adam and not self.offload:  # the update's temporaries
            temp = 2 * max(p.largest_slice for p in plans) if self.pool else \
                sum(p.grads for p in plans)
        yield _Moment("optimizer step", none, temp, 0, frozenset(range(n)), 0)

    def _pooled(self, moments: list[_Moment]) -> list[int]:
        """Unsharded memory at each moment with the staging pool."""
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
