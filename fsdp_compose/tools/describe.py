"""``describe(model)``: what ``fully_shard`` did to a model, as one report
(``print(report)``, or ``report.to_dict()`` as plain JSON types): every
unit, its policies, and which ranks own which elements of each parameter.
Local, on any rank, at any time; FQNs are relative to ``model``. Before the
first forward the root is predicted and the execution order is empty.
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


@dataclass(frozen=True)
class ParamReport:
    """One original parameter inside a flat buffer.

    Attributes:
        fqn, aliases: its name in the model (first registration) and its other
            names (tied within the unit).
        shape, numel, requires_grad: of the original.
        flat_offset: where it starts in the unsharded flat buffer.
        owner_ranks: ranks owning at least one of its elements.
        local_numel, local_offset: this rank's elements and the first's index
            in the flattened original (``param_info(p)``'s).
        placement: ``"flat"``, ``"rows"``, ``"Blocks(n)"``, ``"owned"`` or
            ``"Shard(d)"``."""

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
        trainable: some parameter in it trains.
        dtype, compute_dtype, reduce_dtype: of the shard, the unsharded
            buffer, the reduce-scatter.
        storage_device: where the shard lives.
        params: its parameters, in flat-buffer order.
        numel, padding, unsharded_numel: parameter elements, padding, their
            sum; ``unsharded_bytes`` in ``compute_dtype``.
        shard_numel, shard_bytes: per rank, padding included.
        rank_numels: parameter elements per rank; ``imbalance``: ``max / mean - 1``.
        ranks: the global ranks it shards over.
        own_buffer: the default placement gave its parameter a buffer alone.
        kept_unsharded: ``set_keep_unsharded_storage`` holds ``unsharded_bytes``."""

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
        fqns, module_types: the annotated module(s) (``""``: the model).
        label: its name in the report (``<root>`` for ``""``).
        is_root: root of its model (predicted before the first forward).
        reshard_after_forward, mp_policy, offload_policy: resolved policies.
        world_size, rank: its mesh size and this process's rank in it.
        buffers: its flat buffers; ``unsharded_bytes``, ``shard_bytes``: sums.
        forward_prefetch, backward_prefetch: labels of the units prefetched at
            its forward (backward).
        tied: the parameters it shares with another unit, one line each."""

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
        parameters, trainable: elements of every parameter (a tied one once),
            and of those requiring grad; ``unmanaged``: of those no unit holds.
        sharded_bytes_per_rank, gradient_bytes_per_rank: this rank's shards
            and sharded gradients.
        padding: padding elements over all buffers.
        largest_unit, largest_unit_unsharded_bytes: the unit with the most
            unsharded bytes ("" if none) and its size.
        kept_unsharded_bytes: unsharded bytes kept for the whole run."""

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
        model_type, rank: the model's class name, this process's global rank.
        initialized: whether the root's lazy init ran.
        units: every unit, in module order.
        execution_order: unit labels in the last forward's order.
        prefetch_policy: the root's :class:`PrefetchPolicy` (``None``: no unit).
        buckets: the running or last iteration's coalesced units, labels per bucket;
            ``buckets_gathered_alone_in_backward``: those gathered unit by unit
            in backward.
        unmanaged: FQNs of parameters no unit manages.
        totals: :class:`Totals`."""

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
        """The report as plain JSON types (dtypes as strings, tuples as lists)."""
        return _jsonable(dataclasses.asdict(self))

    def __str__(self) -> str:
        return _render(self)


def describe(model: nn.Module) -> ModelReport:
    """Report the units, flat buffers and parameter assignment of ``model``.
    No collectives: any rank, alone, outside an iteration. ``TypeError`` for
    anything but an ``nn.Module``."""
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
    """ids of the outermost annotated units (the roots, or the predicted ones)."""
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
    """The roots' orders, or a submodule's units' own."""
    found: dict[int, PrefetchOrder] = {}
    for unit in [u for u in units if id(u) in roots] or units:
        prefetch_order = _prefetch_order(unit)
        found.setdefault(id(prefetch_order), prefetch_order)
    return list(found.values())


def _queues(units: list[Unit], roots: set[int]) -> list[CollectiveQueue]:
    """The roots' collective queues (none before the lazy init)."""
    found: dict[int, CollectiveQueue] = {}
    for unit in [u for u in units if id(u) in roots] or units:
        if unit.collectives is not None:
            found.setdefault(id(unit.collectives), unit.collectives)
    return list(found.values())


def _prefetch_order(unit: Unit) -> PrefetchOrder:
    """The unit's prefetch order, or before the lazy init the one it will get."""
    if unit.prefetch_order is not None:
        return unit.prefetch_order
    return PrefetchOrder(pending_model_settings(states_below(unit.modules)))


def _prefetch_plan(unit: Unit) -> tuple[list[Unit], list[Unit]]:
    """What the next iteration prefetches around ``unit``."""
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
    """Parameters of ``model`` no unit manages, once each."""
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


def _render(report: ModelReport) -> str:
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
    """Bytes with the dtype(s) they are counted in."""
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
