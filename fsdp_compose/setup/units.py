"""From ``fully_shard``'s arguments to a running unit: which modules and
parameters a unit takes, how they group into flat buffers, and wiring the
unit into the runtime and the checks. ``tools/planner`` runs the same
planning functions without a process group, so an estimate cannot disagree
with what the library builds.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..buffers import tensor_parallel
from ..buffers.layout import (DEFAULT_PLACEMENT, FLAT, FlatLayout, Placement, ShardDim,
                             check_placement)
from ..buffers.records import (BufferDtypes, BufferPolicy, ParamRecord, apply_dtype_overrides,
                              buffer_layout, group_records, policy_for, resolve_dtypes)
from ..checks.divergence import DivergenceMonitor
from ..checks.late_parameters import check_no_late_parameters, snapshot_modules
from ..checks.replicate import is_replicated
from ..comm.groups import ShardGroup, shard_group_from_mesh
from ..comm.whereabouts import start_watcher
from ..placements import Blocks, OnMesh
from ..policies import CommPolicy, CPUOffloadPolicy, MixedPrecisionPolicy
from .._naming import join_fqn
from ..runtime.owners import record_owners, record_replacement
from ..runtime.state import attach_state, link_annotated_below, state_of
from ..runtime.unit import Unit
from .default_placement import flatten_costly_rows, split_whole_pieces
from .tied import Tie, borrow_from_owner, check_not_owned

PlacementFn = Callable[[nn.Parameter], Optional[object]]
"""FSDP2's ``shard_placement_fn``: a placement (or :class:`OnMesh`, or
``ShardPlacementResult``) per parameter, ``None`` for the unit's."""


def placement_choices(records: list[ParamRecord],
                      shard_placement_fn: Optional[PlacementFn]) -> list[object]:
    """``shard_placement_fn`` of each record's parameter, called once; ``None``
    for each without a function."""
    return [None if shard_placement_fn is None else shard_placement_fn(r.param) for r in records]


def _mesh_of(choice: object) -> Optional[DeviceMesh]:
    if isinstance(choice, OnMesh):
        return choice.mesh
    mesh_info = getattr(choice, "mesh_info", None)  # FSDP2's ShardPlacementResult
    return getattr(mesh_info, "mesh", None)


def _placement_of(choice: object) -> object:
    if isinstance(choice, OnMesh) or hasattr(choice, "mesh_info"):
        return choice.placement
    return choice


def _assign_groups(records: list[ParamRecord], choices: list[object], group: ShardGroup) -> None:
    """Give each record whose choice names another mesh that mesh's shard group
    (one per mesh)."""
    by_mesh: dict[int, ShardGroup] = {}
    for record, choice in zip(records, choices):
        mesh = _mesh_of(choice)
        if mesh is None or mesh == group.mesh:
            continue
        if id(mesh) not in by_mesh:
            by_mesh[id(mesh)] = shard_group_from_mesh(mesh)
        record.group = by_mesh[id(mesh)]

OwnerCheck = Callable[[nn.Parameter, str, nn.Module, dict[int, str]], Optional[bool]]
"""Raises if a parameter already belongs to another unit that cannot share
it; ``False`` where the unit borrows it (a tie, ``setup/tied.py``)."""


class BufferPlan(NamedTuple):
    """One flat buffer a unit gets: its parameters, layout and dtypes."""

    records: list[ParamRecord]
    layout: FlatLayout
    dtypes: BufferDtypes
    requires_grad: bool


# ------------------------------------------------------------------ planning
def managed_modules(modules: Sequence[nn.Module],
                    taken: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """``modules`` and their descendants, minus the subtrees ``taken`` says
    belong to another unit or to ``replicate``."""
    managed: list[nn.Module] = []
    seen: set[int] = set()
    stack = list(reversed(modules))
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        managed.append(m)
        for child in reversed(list(m.children())):
            if not taken(child):
                stack.append(child)
    return managed


def module_names(modules: Sequence[nn.Module]) -> dict[int, str]:
    """Every module below ``modules`` by id, named relative to them (``[i].``
    prefixes for a list of siblings)."""
    names: dict[int, str] = {}
    for i, top in enumerate(modules):
        prefix = f"[{i}]." if len(modules) > 1 else ""
        for name, sub in top.named_modules(remove_duplicate=False):
            names.setdefault(id(sub), (prefix + name).rstrip("."))
    return names


def collect_records(modules: Sequence[nn.Module], managed: Sequence[nn.Module],
                    ignored: set[int], check_owner: OwnerCheck) -> list[ParamRecord]:
    """One record per distinct parameter of ``managed`` in module order (one
    registered twice gets two slots), skipping ``ignored`` ids and those
    ``check_owner`` borrows."""
    names = module_names(modules)
    records: dict[int, ParamRecord] = {}
    for m in managed:
        for attr, param in m._parameters.items():
            if param is None or id(param) in ignored:
                continue
            fqn = join_fqn(names.get(id(m), ""), attr)
            if id(param) in records:
                records[id(param)].slots.append((m, attr))
                continue
            if check_owner(param, fqn, m, names) is False:
                continue
            records[id(param)] = ParamRecord(param=param, slots=[(m, attr)], fqn=fqn,
                                             shape=param.shape)
    return list(records.values())


def plan_buffers(records: list[ParamRecord], world_size: int,
                 policy: BufferPolicy) -> list[BufferPlan]:
    """The flat buffers of a unit: one per group of ``group_records``."""
    return [BufferPlan(group, buffer_layout(group, world_size, policy),
                       resolve_dtypes(group[0].param.dtype, policy_for(group, policy)),
                       group[0].param.requires_grad)
            for group in group_records(records)]


# --------------------------------------------------------------- fully_shard
def setup_unit(module: Union[nn.Module, Sequence[nn.Module]], modules: list[nn.Module],
               group: ShardGroup, ignored: set[int],
               reshard_after_forward: Union[bool, int, None],
               mp_policy: Optional[MixedPrecisionPolicy],
               offload_policy: Optional[CPUOffloadPolicy],
               placement: object = None,
               shard_placement_fn: Optional[PlacementFn] = None,
               spmd_mesh: Optional[DeviceMesh] = None,
               comm_policy: Optional[CommPolicy] = None) -> Unit:
    """Take the parameters of ``modules`` into a new unit over ``group`` and
    attach its state (hooks) and checks.

    Post-condition: every taken parameter is a view of its buffer's shard and
    recorded as owned by the unit; units annotated below know their root."""
    managed = managed_modules(modules, taken)
    tied: list[Tie] = []
    records = collect_records(modules, managed, ignored,
                              functools.partial(check_not_owned, group=group, tied=tied))
    choices = placement_choices(records, shard_placement_fn)
    _assign_groups(records, choices, group)
    _localize_tensor_parallel(records, group, spmd_mesh)
    flattened = assign_placements(records, placement, choices, group.world_size,
                                  steps_on_cpu=group.device.type == "cpu")
    if flattened and group.rank == 0:
        _warn_flattened(flattened)
    _check_params(records, group.device)
    apply_dtype_overrides(records, mp_policy)
    unit = Unit(modules, managed, group_records(records), group, reshard_after_forward,
                mp_policy, offload_policy, comm_policy)
    if mp_policy is not None and mp_policy.buffer_dtype is not None:
        _cast_buffers(managed, mp_policy.buffer_dtype)
    record_owners(unit)
    for tie in tied:
        borrow_from_owner(unit, tie)
    attach_state(module, unit, new_observer=DivergenceMonitor,
                 pre_forward_check=functools.partial(check_no_late_parameters,
                                                     snapshot_modules(unit.managed_modules)))
    link_annotated_below(state_of(modules[0]))
    start_watcher()  # other ranks may ask where this one is ([Note: blocked is not late])
    if len(modules) == 1:
        _rename_below(modules[0])
    return unit


def _warn_flattened(flattened: list[ParamRecord]) -> None:
    names = ", ".join(f"'{r.fqn}' {tuple(r.shape)}" for r in flattened[:8])
    more = f" and {len(flattened) - 8} more" if len(flattened) > 8 else ""
    warnings.warn(
        f"fully_shard: {names}{more} are sharded 'flat' (1-D between steps: p.dim() is 1) "
        "because whole rows of them would pad their buffer by over 1% more than 'flat' "
        "(docs/placements.md, 'What they cost'). Rules on p.dim() / p.ndim (weight decay, "
        "Muon) see them as 1-D: use len(fsdp_compose.param_info(p).shape), or pass "
        "placement='rows' to keep rows whatever the padding.", stacklevel=4)


def as_placement(value: object) -> object:
    """FSDP2's ``Shard(d)`` as ``ShardDim(d)``; the rest as is."""
    if isinstance(value, Shard):
        return ShardDim(value.dim)
    return value


def check_unit_placement(placement: object) -> None:
    """Reject a unit-wide placement no parameter could take, before anything is
    built."""
    if placement is None:
        return
    placement = as_placement(placement)
    if not (placement in ("flat", "rows", "owned")
            or isinstance(placement, (Blocks, ShardDim))):
        raise ValueError(f"placement must be 'flat', 'rows', 'owned', Blocks(n) or Shard(dim), "
                         f"got {placement!r}")


def assign_placements(records: list[ParamRecord], placement: object,
                      choices: Optional[Sequence[Any]],
                      world_size: int, steps_on_cpu: bool = False) -> list[ParamRecord]:
    """Each record's placement: its choice, else the unit's, checked against its
    shape (a unit-wide placement a 0-dim parameter cannot take leaves it
    ``"flat"``; a chosen one raises); the unit's ``None`` is
    ``setup/default_placement.py``'s rule. Returns the multi-dimensional
    parameters the default made ``"flat"``."""
    defaulted = placement is None
    unit_placement = DEFAULT_PLACEMENT if defaulted else placement
    by_default = []
    for index, r in enumerate(records):
        chosen = None if choices is None else _placement_of(choices[index])
        if chosen is None and defaulted:
            by_default.append(r)
        value: Placement = as_placement(unit_placement if chosen is None else chosen)
        if r.tp is not None and value != FLAT:
            if chosen is None:
                continue  # a unit-wide placement: tensor-parallel parameters stay flat
            if not isinstance(value, ShardDim):
                raise ValueError(f"parameter '{r.fqn}' is tensor-parallel; only the 'flat' and "
                                 f"Shard(d) placements are supported for it, got {value!r}")
        r.placement = check_placement(value, r.shape, r.fqn, explicit=chosen is not None)
    if not by_default:
        return []
    flattened = flatten_costly_rows(records, by_default, world_size)
    if steps_on_cpu:
        split_whole_pieces(records, by_default, world_size)
    return [r for r in flattened if len(r.shape) > 1]


def taken(module: nn.Module) -> bool:
    """Annotated before, or owned by ``replicate``."""
    return state_of(module) is not None or is_replicated(module)


def _localize_tensor_parallel(records: list[ParamRecord], group: ShardGroup,
                              spmd_mesh: Optional[DeviceMesh] = None) -> None:
    """Replace every ``DTensor`` parameter by a plain one of its TP-local values
    under the same names (a DTensor parameter cannot keep its identity, see
    ``tensor_parallel.py``). With ``spmd_mesh`` every parameter must be one."""
    if spmd_mesh is not None:
        plain = next((r for r in records if not isinstance(r.param, DTensor)), None)
        if plain is not None:
            raise ValueError(
                f"parameter '{plain.fqn}' is a plain tensor, but fully_shard got dp_mesh_dims: "
                "every parameter must then be a DTensor on the mesh passed to fully_shard "
                "(distribute_module / distribute_tensor over it, Replicate() on the data-"
                "parallel dims).")
    for r in (r for r in records if isinstance(r.param, DTensor)):
        original = r.param
        r.param, r.tp = tensor_parallel.localize(r.param, r.fqn, r.group or group,
                                                 None if r.group else spmd_mesh)
        record_replacement(original, r.param)
        r.shape = r.param.shape
        for module, attr in r.slots:
            module._parameters[attr] = r.param


def _check_params(records: list[ParamRecord], device: torch.device) -> None:
    """Reject what cannot be sharded, naming the parameter and the fix."""
    devices: dict[torch.device, str] = {}
    for r in records:
        devices.setdefault(r.param.device, r.fqn)
    if len(devices) > 1 and torch.device("meta") in devices:
        real = next(fqn for dev, fqn in devices.items() if dev.type != "meta")
        meta = devices[torch.device("meta")]
        raise ValueError(
            f"fully_shard got a unit with parameters on the meta device ('{meta}') "
            f"and materialised ones ('{real}'); build the whole module on the meta device (then "
            "fsdp_compose.materialize(model) after fully_shard), or on a real device.")
    if len(devices) > 1:
        listing = ", ".join(f"'{fqn}' on {dev}" for dev, fqn in devices.items())
        raise ValueError(f"parameters of one fully_shard unit are on different devices ({listing});"
                         " move the module to one device first (module.to(device)).")
    for r in records:
        p = r.param
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"parameter '{r.fqn}' has layout {p.layout}; fully_shard needs dense "
                             "(strided) parameters. Convert it, or pass it in ignored_params.")
        if not p.is_contiguous():
            raise ValueError(f"parameter '{r.fqn}' is not contiguous (strides {p.stride()}); "
                             "make it contiguous (param.data = param.data.contiguous()) before "
                             "fully_shard.")
        if p.device.type not in (device.type, "cpu", "meta"):
            raise ValueError(f"parameter '{r.fqn}' is on {p.device} but the mesh computes on "
                             f"{device}; move the module to the mesh's device (or pass a "
                             "matching mesh).")
    for r in records:
        r.param.grad = None  # a gradient of the unsharded shape means nothing once sharded


def _cast_buffers(modules: list[nn.Module], dtype: torch.dtype) -> None:
    for m in modules:
        for name, buf in m._buffers.items():
            if buf is not None and buf.is_floating_point():
                m._buffers[name] = buf.to(dtype)


def _rename_below(top: nn.Module) -> None:
    """Make the FQNs of every unit below ``top`` relative to ``top``."""
    names = {id(m): n for n, m in top.named_modules(remove_duplicate=False)}
    for name, sub in top.named_modules():
        state = state_of(sub)
        if state is None or state.unit.modules[0] is not sub:
            continue
        for buffer in state.unit.buffers:
            for record in buffer.records:
                module, attr = record.slots[0]
                record.fqn = join_fqn(names.get(id(module), name), attr)
