"""``describe(model)``: what ``fully_shard`` did to a model, as one report.

Usage, on any rank, before or after the first forward (no collectives)::

    import fsdp_compose
    report = fsdp_compose.describe(model)
    print(report)                        # a table per unit, then totals
    json.dumps(report.to_dict())         # the same, as plain JSON types

The report lists every unit (the modules of one ``fully_shard`` call), its
resolved policies, and per flat buffer the original parameters it holds:
where each one starts in the unsharded buffer, which ranks own part of it
and which elements this rank owns. This is the parameter assignment that
FSDP's users must otherwise reconstruct from the layout rules (see
``buffers/layout.py``). Every FQN is relative to the ``model`` passed in.

Before the first forward no root has been chosen yet: the report predicts
it (the outermost annotated unit, as the first forward will decide), the
execution order is empty and so is the order-based prefetch plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .._naming import join_fqn
from ..buffers.flat_buffer import FlatBuffer
from ..buffers.layout import ShardDim
from ..placements import Blocks
from ..policies import CPUOffloadPolicy, MixedPrecisionPolicy, PrefetchPolicy
from ..runtime.owners import owner_of
from .._naming import user_class_name
from ..runtime.collective_queue import CollectiveQueue
from ..runtime.prefetch_order import PrefetchOrder
from ..runtime.state import ROOT_LABEL, pending_model_settings, state_of, states_below, units_below
from ..runtime.tied import TiedParameter
from ..runtime.unit import Unit
from ._format import format_bytes, module_paths


# ------------------------------------------------------------------ report
@dataclass(frozen=True)
class ParamReport:
    """One original parameter inside a flat buffer.

    Attributes:
        fqn: its name relative to the described model (the first name a
            module registers it under).
        aliases: its other names (a tied weight registered twice in the unit).
        shape: original shape.
        numel: original number of elements.
        requires_grad: as the parameter says now.
        flat_offset: where it starts in the unsharded flat buffer.
        owner_ranks: the ranks that own at least one of its elements.
        local_numel: elements this rank owns (``param.numel()`` between
            iterations; as ``param_info(p).local_numel``).
        local_offset: index of the first of them in the flattened original
            (as ``param_info(p).local_offset``; meaningless when
            ``local_numel == 0``).
        placement: how it is cut (``"flat"``, ``"rows"``, ``"Blocks(n)"``,
            ``"owned"``, ``"Shard(d)"``; see docs/placements.md).
    """

    fqn: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    numel: int
    requires_grad: bool
    flat_offset: int
    owner_ranks: tuple[int, ...]
    local_numel: int
    local_offset: int
    placement: str = "flat"


@dataclass(frozen=True)
class BufferReport:
    """One flat buffer of a unit.

    Attributes:
        trainable: whether some parameter in it trains (frozen buffers get no
            gradient memory and no reduce-scatter).
        dtype: the parameters' (and sharded gradients') dtype.
        compute_dtype: dtype of the unsharded buffer and the all-gather.
        reduce_dtype: dtype of the reduce-scatter.
        storage_device: where the shard lives (the CPU when offloaded).
        params: the original parameters, in flat-buffer order.
        numel: sum of their numels (no padding).
        padding: elements added so that every rank's chunk is equal and 16-byte
            aligned (at the end under "flat"; also between parameters under
            the other placements).
        unsharded_numel: ``numel + padding``, the all-gathered buffer.
        unsharded_bytes: its size in ``compute_dtype``.
        shard_numel: elements per rank (``unsharded_numel / world_size``,
            the same on every rank, padding included).
        shard_bytes: per-rank shard size in ``dtype`` (a trainable buffer's
            sharded gradient has the same size).
        rank_numels: parameter elements (no padding) in each rank's chunk;
            equal up to one element under "flat", uneven under the other
            placements, which cut only at rows or whole parameters.
        imbalance: ``max(rank_numels) / mean - 1`` (0: perfectly even): how
            much more optimizer state and compute the most loaded rank has.
        ranks: the global ranks it shards over (its unit's mesh, or the
            mesh ``shard_placement_fn`` chose, :class:`OnMesh`).
        own_buffer: the default placement put its one parameter alone in it
            (on a CPU mesh, so that no rank holds much more of it than
            FSDP2's ``Shard(0)``: ``default_placement.split_whole_pieces``).
        kept_unsharded: its unsharded storage is kept between uses
            (``set_keep_unsharded_storage``): ``unsharded_bytes`` held for
            the whole run, sharded or not.
    """

    trainable: bool
    dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    storage_device: str
    params: tuple[ParamReport, ...]
    numel: int
    padding: int
    unsharded_numel: int
    unsharded_bytes: int
    shard_numel: int
    shard_bytes: int
    rank_numels: tuple[int, ...] = ()
    imbalance: float = 0.0
    ranks: tuple[int, ...] = ()
    own_buffer: bool = False
    kept_unsharded: bool = False


@dataclass(frozen=True)
class UnitReport:
    """One unit (one ``fully_shard`` call).

    Attributes:
        fqns: the annotated module(s) (``""``: the described model itself).
        module_types: their class names.
        label: how the report names the unit elsewhere (execution order,
            prefetch plan): the FQNs joined, ``<root>`` for ``""``.
        is_root: the root of its model (predicted before the first forward).
        reshard_after_forward: resolved (``None`` given: not for the root).
        mp_policy / offload_policy: as given to ``fully_shard``.
        world_size / rank: the unit's mesh, and this process's rank in it.
        buffers: its flat buffers (one per dtype and ``requires_grad``).
        forward_prefetch: labels of the units whose all-gather the next
            forward issues before this unit's (explicit, or by the recorded
            order under the prefetch policy; empty before a forward).
        backward_prefetch: the same when this unit's backward starts.
        unsharded_bytes / shard_bytes: sums over the buffers.
        tied: the parameters this unit shares with another unit (tied
            weights), one line each: ``"'lm_head.weight' is
            'model.embed_tokens.weight' of <owner unit>"``; the owner's
            buffer holds it (its table lists the borrowing name as an alias).
    """

    fqns: tuple[str, ...]
    module_types: tuple[str, ...]
    label: str
    is_root: bool
    reshard_after_forward: bool
    mp_policy: MixedPrecisionPolicy
    offload_policy: Optional[CPUOffloadPolicy]
    world_size: int
    rank: int
    buffers: tuple[BufferReport, ...]
    forward_prefetch: tuple[str, ...]
    backward_prefetch: tuple[str, ...]
    unsharded_bytes: int
    shard_bytes: int
    tied: tuple[str, ...] = ()


@dataclass(frozen=True)
class Totals:
    """Sums over the whole report.

    Attributes:
        parameters: elements of every parameter of the model (managed or not;
            a tied weight counts once).
        trainable: those of them that require grad.
        unmanaged: elements of parameters no unit manages (``ignored_params``,
            ``replicate``): replicated, whole on every rank.
        sharded_bytes_per_rank: this rank's shards of every buffer.
        gradient_bytes_per_rank: this rank's sharded gradients (trainable
            buffers only).
        padding: padding elements over all buffers.
        largest_unit: label of the unit with the most unsharded bytes ("" if
            there is no unit); roughly the peak parameter memory is the root
            plus two such units during forward.
        largest_unit_unsharded_bytes: its unsharded size.
        kept_unsharded_bytes: unsharded bytes held for the whole run by
            buffers that keep their unsharded storage
            (``set_keep_unsharded_storage``), on top of the shards.
    """

    parameters: int
    trainable: int
    unmanaged: int
    sharded_bytes_per_rank: int
    gradient_bytes_per_rank: int
    padding: int
    largest_unit: str
    largest_unit_unsharded_bytes: int
    kept_unsharded_bytes: int = 0


@dataclass(frozen=True)
class ModelReport:
    """What ``fully_shard`` did to one model, as seen from one rank.

    Attributes:
        model_type: class name of the described model.
        rank: this process's global rank (0 without ``torch.distributed``).
        initialized: whether the first forward (the root's lazy init) ran.
        units: every unit in the model, in module order.
        execution_order: unit labels in the order their forward started in
            the last forward (empty before the first one).
        prefetch_policy: the root's :class:`PrefetchPolicy` (``None``: no unit).
        buckets: the units whose collectives the next iteration coalesces,
            one tuple of unit labels per bucket (``set_bucket_cap_mb``;
            empty before the first backward and with bucketing off).
        buckets_gathered_alone_in_backward: the buckets (as in ``buckets``)
            whose members are all-gathered one by one in backward: the
            first bucket backward reaches, the last of each root's.
        unmanaged: FQNs of parameters no unit manages.
        totals: sums, see :class:`Totals`.
    """

    model_type: str
    rank: int
    initialized: bool
    units: tuple[UnitReport, ...]
    execution_order: tuple[str, ...]
    prefetch_policy: Optional[PrefetchPolicy]
    buckets: tuple[tuple[str, ...], ...]
    unmanaged: tuple[str, ...]
    totals: Totals
    buckets_gathered_alone_in_backward: tuple[tuple[str, ...], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON types (dtypes as strings like
        ``"float32"``, tuples as lists)."""
        return _jsonable(dataclasses.asdict(self))

    def __str__(self) -> str:
        return _render(self)


# --------------------------------------------------------------- building
def describe(model: nn.Module) -> ModelReport:
    """Report the units, flat buffers and parameter assignment of ``model``
    (annotated by ``fully_shard`` in place). Local: no collectives, so any
    rank may call it, alone, at any time between or after iterations."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"describe takes an nn.Module, got {type(model).__name__}")
    units = units_below(model)
    paths = module_paths(model)
    labels = {id(u): _label(_unit_fqns(u, paths)) for u in units}
    initialized = any(_initialized(u) for u in units)
    roots = _roots(model, units, initialized)
    orders = _prefetch_orders(units, roots)
    order = [u for s in orders for u in s.recorded_order()]
    unit_reports = tuple(_unit_report(u, paths, labels, id(u) in roots) for u in units)
    unmanaged = _unmanaged(model, units)
    buckets = [b for queue in _queues(units, roots) for b in queue.buckets.buckets]

    def named(bucket) -> tuple[str, ...]:
        return tuple(labels.get(id(u), u.name) for u in bucket.units)
    return ModelReport(
        model_type=user_class_name(model),
        rank=dist.get_rank() if dist.is_available() and dist.is_initialized() else 0,
        initialized=initialized,
        units=unit_reports,
        execution_order=tuple(labels.get(id(u), u.name) for u in order),
        prefetch_policy=orders[0].settings.prefetch_policy if orders else None,
        buckets=tuple(named(b) for b in buckets),
        unmanaged=tuple(fqn for fqn, _ in unmanaged),
        totals=_totals(unit_reports, unmanaged),
        buckets_gathered_alone_in_backward=tuple(
            named(b) for b in buckets if not b.gathered_in_backward),
    )


def _unit_fqns(unit: Unit, paths: dict[int, list[str]]) -> tuple[str, ...]:
    # a unit outside the described model (describe(submodule)): its own name
    return tuple(paths[id(m)][0] if id(m) in paths else unit.name for m in unit.modules)


def _label(fqns: tuple[str, ...]) -> str:
    return ", ".join(f or ROOT_LABEL for f in fqns)


def _initialized(unit: Unit) -> bool:
    state = state_of(unit.modules[0])
    return state is not None and state.context is not None


def _roots(model: nn.Module, units: list[Unit], initialized: bool) -> set[int]:
    """ids of the units that are (or, before the first forward, will be)
    roots: after lazy init, as recorded; before it, the outermost annotated
    units (the first forward makes the outermost annotated module the root)."""
    if initialized:
        return {id(u) for u in units if u.is_root}
    roots: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        state = state_of(module)
        if state is not None:
            roots.add(id(state.unit))
            continue  # everything below belongs to this root
        stack.extend(module.children())
    return roots


def _prefetch_orders(units: list[Unit], roots: set[int]) -> list[PrefetchOrder]:
    """The roots' orders (every unit shares its root's after lazy init);
    for a submodule whose root lies outside it, its units' orders."""
    found: dict[int, PrefetchOrder] = {}
    for unit in [u for u in units if id(u) in roots] or units:
        prefetch_order = _prefetch_order(unit)
        found.setdefault(id(prefetch_order), prefetch_order)
    return list(found.values())


def _queues(units: list[Unit], roots: set[int]) -> list[CollectiveQueue]:
    """The roots' collective queues (none before the lazy init), as
    :func:`_prefetch_orders` finds the orders."""
    found: dict[int, CollectiveQueue] = {}
    for unit in [u for u in units if id(u) in roots] or units:
        if unit.collectives is not None:
            found.setdefault(id(unit.collectives), unit.collectives)
    return list(found.values())


def _prefetch_order(unit: Unit) -> PrefetchOrder:
    """The unit's prefetch order; before the root's lazy init, the one it will
    get: the policy set on any module of its subtree (else the default),
    nothing recorded yet."""
    if unit.prefetch_order is not None:
        return unit.prefetch_order
    return PrefetchOrder(pending_model_settings(states_below(unit.modules)))


def _prefetch_plan(unit: Unit) -> tuple[list[Unit], list[Unit]]:
    """What the next iteration prefetches around ``unit``: the prefetch order's
    own choice with the recorded order (the in-flight limit may still hold
    some back)."""
    prefetch_order = _prefetch_order(unit)
    order = prefetch_order.recorded_order()
    return prefetch_order.forward_targets(unit, order), prefetch_order.backward_targets(unit, order)


def _unit_report(unit: Unit, paths: dict[int, list[str]], labels: dict[int, str],
                 is_root: bool) -> UnitReport:
    fqns = _unit_fqns(unit, paths)
    reshard = unit.settings.reshard_after_forward
    forward, backward = _prefetch_plan(unit)
    buffers = tuple(_buffer_report(b, paths) for b in unit.buffers)
    return UnitReport(
        fqns=fqns,
        module_types=tuple(user_class_name(m) for m in unit.modules),
        label=labels[id(unit)],
        is_root=is_root,
        reshard_after_forward=(not is_root) if reshard is None else bool(reshard),
        mp_policy=unit.settings.mp_policy,
        offload_policy=unit.settings.offload_policy,
        world_size=unit.group.world_size,
        rank=unit.group.rank,
        buffers=buffers,
        forward_prefetch=tuple(labels.get(id(u), u.name) for u in forward),
        backward_prefetch=tuple(labels.get(id(u), u.name) for u in backward),
        unsharded_bytes=sum(b.unsharded_bytes for b in buffers),
        shard_bytes=sum(b.shard_bytes for b in buffers),
        tied=tuple(_tied_line(tie, unit, labels) for tie in unit.ties),
    )


def _tied_line(tie: TiedParameter, unit: Unit, labels: dict[int, str]) -> str:
    """One tie as the unit sees it: borrowed (lives in the owner) or lent."""
    if tie.borrower is unit:
        owner = labels.get(id(tie.owner), tie.owner.name)
        return f"'{tie.fqn}' is '{tie.owner_fqn}' of unit {owner} (its buffer holds it)"
    borrower = labels.get(id(tie.borrower), tie.borrower.name)
    return f"'{tie.owner_fqn}' is also '{tie.fqn}' of unit {borrower} (held here)"



def _buffer_report(buffer: FlatBuffer, paths: dict[int, list[str]]) -> BufferReport:
    layout = buffer.layout
    params = []
    for index, (record, local) in enumerate(zip(buffer.records, buffer.local_slices())):
        names = [join_fqn(path, attr) for module, attr in record.slots
                 for path in paths.get(id(module), [])]
        names = list(dict.fromkeys(names)) or [record.fqn]  # outside the model: its own FQN
        params.append(ParamReport(
            fqn=names[0], aliases=tuple(names[1:]), shape=tuple(record.shape),
            numel=layout.numels[index], requires_grad=record.param.requires_grad,
            flat_offset=layout.offsets[index], owner_ranks=tuple(layout.owner_ranks(index)),
            local_numel=local.length, local_offset=local.param_start,
            placement=placement_name(layout.placements[index])))
    loads = layout.rank_numels()
    return BufferReport(
        trainable=buffer.requires_grad, dtype=buffer.dtype, compute_dtype=buffer.compute_dtype,
        reduce_dtype=buffer.reduce_dtype, storage_device=str(buffer.storage_device),
        params=tuple(params), numel=layout.numel, padding=layout.padding,
        unsharded_numel=layout.padded_numel,
        unsharded_bytes=layout.padded_numel * buffer.compute_dtype.itemsize,
        shard_numel=layout.shard_numel, shard_bytes=layout.shard_numel * buffer.dtype.itemsize,
        rank_numels=loads, imbalance=_imbalance(loads),
        ranks=tuple(dist.get_process_group_ranks(buffer.group.process_group)),
        own_buffer=buffer.records[0].own_buffer,
        kept_unsharded=buffer.keeps_unsharded_storage and not buffer.aliased)


def placement_name(placement: object) -> str:
    """``"flat"``, ``"rows"``, ``"owned"``, ``"Blocks(n)"`` or ``"Shard(d)"``."""
    if isinstance(placement, str):
        return placement
    if isinstance(placement, Blocks):
        return f"Blocks({placement.n})"
    if isinstance(placement, ShardDim):
        return f"Shard({placement.dim})"
    return repr(placement)


def _imbalance(loads: tuple[int, ...]) -> float:
    total = sum(loads)
    return max(loads) * len(loads) / total - 1 if total else 0.0


def _unmanaged(model: nn.Module, units: list[Unit]) -> list[tuple[str, nn.Parameter]]:
    """Parameters of ``model`` that no unit manages, once each. While a unit
    is unsharded its slots hold plain-tensor views, never ``nn.Parameter``s."""
    slots = {(id(m), attr) for u in units for b in u.buffers for r in b.records
             for m, attr in r.slots}
    found: dict[int, tuple[str, nn.Parameter]] = {}
    for name, module in model.named_modules():
        for attr, param in module._parameters.items():
            if isinstance(param, nn.Parameter) and (id(module), attr) not in slots \
                    and owner_of(param) is None:
                found.setdefault(id(param), (join_fqn(name, attr), param))
    return list(found.values())


def _totals(units: tuple[UnitReport, ...],
            unmanaged: list[tuple[str, nn.Parameter]]) -> Totals:
    params = [p for u in units for b in u.buffers for p in b.params]
    largest = max(units, key=lambda u: u.unsharded_bytes, default=None)
    extra = sum(p.numel() for _, p in unmanaged)
    return Totals(
        parameters=sum(p.numel for p in params) + extra,
        trainable=sum(p.numel for p in params if p.requires_grad)
        + sum(p.numel() for _, p in unmanaged if p.requires_grad),
        unmanaged=extra,
        sharded_bytes_per_rank=sum(u.shard_bytes for u in units),
        gradient_bytes_per_rank=sum(b.shard_bytes for u in units for b in u.buffers
                                    if b.trainable),
        padding=sum(b.padding for u in units for b in u.buffers),
        largest_unit=largest.label if largest is not None else "",
        largest_unit_unsharded_bytes=largest.unsharded_bytes if largest is not None else 0,
        kept_unsharded_bytes=sum(b.unsharded_bytes for u in units for b in u.buffers
                                 if b.kept_unsharded),
    )


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, torch.device):
        return str(value)
    if callable(value):  # MixedPrecisionPolicy.param_dtype_override_fn
        return getattr(value, "__qualname__", repr(value))
    return value


# ---------------------------------------------------------------- rendering
def _render(report: ModelReport) -> str:
    """The text report: a header, one table per unit, order and totals."""
    units, totals = report.units, report.totals
    n_buffers = sum(len(u.buffers) for u in units)
    world = ", ".join(sorted({f"{u.rank} of {u.world_size}" for u in units})) or "-"
    lines = [f"fsdp_compose: {report.model_type}, {len(units)} units, {n_buffers} flat buffers "
             f"(rank {world})"]
    if not report.initialized:
        lines.append("no forward yet: root predicted, no execution order recorded")
    for index, unit in enumerate(units):
        lines.append("")
        lines.extend(_render_unit(unit, index, len(units)))
    lines.append("")
    if report.execution_order:
        lines.append("execution order (last forward): " + " -> ".join(report.execution_order))
        policy = report.prefetch_policy
        if policy is not None:
            lines.append(f"prefetch (forward={policy.forward}, backward={policy.backward}, at "
                         f"most {policy.max_inflight_all_gathers} all-gathers in flight):")
        for unit in units:
            fwd = ", ".join(unit.forward_prefetch) or "-"
            bwd = ", ".join(unit.backward_prefetch) or "-"
            lines.append(f"  {unit.label}: before forward -> {fwd}; at backward -> {bwd}")
    for bucket in report.buckets:
        gathers = "one all-gather in forward, one per unit in backward (the first bucket " \
            "backward reaches)" if bucket in report.buckets_gathered_alone_in_backward else \
            "one all-gather"
        lines.append(f"bucket of {len(bucket)} units ({gathers}, one reduce-scatter): "
                     + ", ".join(bucket))
    if report.unmanaged:
        lines.append("not sharded (replicated on every rank): " + ", ".join(report.unmanaged))
    lines.append(
        f"totals: {totals.parameters:,} parameters ({totals.trainable:,} trainable); per rank "
        f"{format_bytes(totals.sharded_bytes_per_rank)} sharded parameters, "
        f"{format_bytes(totals.gradient_bytes_per_rank)} sharded gradients; "
        f"{totals.padding:,} padding elements")
    if totals.largest_unit:
        lines.append(f"largest unit unsharded: {totals.largest_unit}, "
                     f"{format_bytes(totals.largest_unit_unsharded_bytes)}")
    if totals.kept_unsharded_bytes:
        lines.append(f"unsharded storage kept between uses (set_keep_unsharded_storage): "
                     f"{format_bytes(totals.kept_unsharded_bytes)} per rank, held always")
    return "\n".join(lines)


def _render_unit(unit: UnitReport, index: int, count: int) -> list[str]:
    modules = ", ".join(f"{f or ROOT_LABEL} ({t})" for f, t in zip(unit.fqns, unit.module_types))
    root = "root, " if unit.is_root else ""
    lines = [f"unit {index + 1}/{count}: {modules}",
             f"  {root}reshard_after_forward={unit.reshard_after_forward}, "
             f"{_precision(unit.mp_policy)}, {_offload(unit.offload_policy)}; "
             f"unsharded {_sized(unit.unsharded_bytes, [b.compute_dtype for b in unit.buffers])}, "
             f"per rank {_sized(unit.shard_bytes, [b.dtype for b in unit.buffers])}"]
    if not unit.buffers:
        lines.append("  no parameters of its own (units below took them all)")
    for tie in unit.tied:
        lines.append(f"  tied: {tie}")
    for b_index, buffer in enumerate(unit.buffers):
        kind = "trainable" if buffer.trainable else "frozen"
        dtypes = f"{_dtype(buffer.dtype)}"
        if buffer.compute_dtype != buffer.dtype or buffer.reduce_dtype != buffer.dtype:
            dtypes += f" (compute {_dtype(buffer.compute_dtype)}, " \
                      f"reduce {_dtype(buffer.reduce_dtype)})"
        lines.append(
            f"  buffer {b_index}: {kind} {dtypes} on {buffer.storage_device}: "
            f"{buffer.numel:,} + {buffer.padding} padding = {buffer.unsharded_numel:,} elements "
            f"({_sized(buffer.unsharded_bytes, [buffer.compute_dtype])}"
            f"{', kept' if buffer.kept_unsharded else ''}); {buffer.shard_numel:,} "
            f"per rank ({_sized(buffer.shard_bytes, [buffer.dtype])})")
        if len(buffer.ranks) != unit.world_size:
            lines.append(f"    sharded over ranks {list(buffer.ranks)} (another mesh than the unit's)")
        if buffer.own_buffer:
            lines.append("    a buffer of its own: beside the unit's other parameters a rank would "
                         "hold much more of it than FSDP2 does (docs/placements.md)")
        placements = sorted({p.placement for p in buffer.params})
        if placements != ["flat"] or buffer.imbalance > 0.01:
            loads = buffer.rank_numels
            lines.append(f"    placement {', '.join(placements)}: parameter elements per rank "
                         f"{min(loads):,} to {max(loads):,}, the most loaded "
                         f"+{100 * buffer.imbalance:.1f}% over the mean")
        rows = [("parameter", "shape", "numel", "flat offset", "ranks", f"rank {unit.rank} owns")]
        for p in buffer.params:
            name = p.fqn + (f" (= {', '.join(p.aliases)})" if p.aliases else "")
            if not p.requires_grad and buffer.trainable:
                name += " [frozen]"
            mine = f"[{p.local_offset}:{p.local_offset + p.local_numel}]" if p.local_numel else "-"
            rows.append((name, "x".join(map(str, p.shape)) or "scalar", f"{p.numel:,}",
                         f"{p.flat_offset:,}", _ranks(p.owner_ranks), mine))
        lines.extend("    " + line for line in _table(rows, right={2, 3}))
    return lines


def _table(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) if c in right else cell.ljust(w)
                      for c, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]


def _ranks(ranks: tuple[int, ...]) -> str:
    if not ranks:
        return "-"
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sized(nbytes: int, dtypes: list[torch.dtype]) -> str:
    """Bytes with the dtype(s) they are counted in (unsharded and sharded
    sizes differ in dtype under mixed precision: side by side they must not
    read as one)."""
    named = sorted({_dtype(d) for d in dtypes})
    return f"{format_bytes(nbytes)} {'/'.join(named)}" if named else format_bytes(nbytes)


def _precision(policy: MixedPrecisionPolicy) -> str:
    if policy == MixedPrecisionPolicy():
        return "full precision"
    parts = [f"{name} {_dtype(getattr(policy, name))}"
             for name in ("param_dtype", "reduce_dtype", "output_dtype", "buffer_dtype")
             if getattr(policy, name) is not None]
    if policy.reduce_dtype is None and policy.reduce_follows_grad_dtype:
        parts.append("reduce in the parameters' dtype")
    if policy.param_dtype_override_fn is not None:
        parts.append("per-parameter param_dtype_override_fn")
    return "mixed precision (" + ", ".join(parts) + ")"


def _offload(policy: Optional[CPUOffloadPolicy]) -> str:
    if policy is None:
        return "no offload"
    return "CPU offload" + (" (pinned)" if policy.pin_memory else "")
