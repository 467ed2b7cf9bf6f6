"""Public API: ``fully_shard`` and the methods an annotated module gains.

Usage (run under ``torchrun``; see ``examples/train_gpt.py``)::

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ._comm import default_mesh, shard_group_from_mesh
from ._compose import check_not_replicated, is_replicated
from ._flat_buffer import FlatBuffer, ParamRecord
from ._owners import Owner, owner_of, register_owner
from . import _tensor_parallel
from ._state import link_annotated_below, register_unit, state_of
from ._step_guard import install_step_guard
from .checkpoint import UnitStateDictHooks
from ._unit import ShardUnit
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy
from .torch_policies import as_mp_policy, as_offload_policy
from . import torch_norms
from .sharded_module import _sharded_class, check_reshard_after_forward

ModuleOrModules = Union[nn.Module, Sequence[nn.Module]]

class ShardedParamInfo(NamedTuple):
    """What a sharded parameter was before sharding, and what this rank holds.

    Attributes:
        fqn: original fully-qualified name, relative to the outermost module
            annotated so far (the root once the whole model is annotated).
        shape: original shape (``param`` itself is 1-D between iterations).
        numel: original number of elements.
        local_numel: elements of it this rank owns (``param.numel()``).
        local_offset: index, in the flattened original, of the first owned
            element (meaningless when ``local_numel == 0``).
    """

    fqn: str
    shape: torch.Size
    numel: int
    local_numel: int
    local_offset: int


def fully_shard(module: ModuleOrModules, *, mesh: Optional[DeviceMesh] = None,
                reshard_after_forward: Union[bool, int, None] = None,
                mp_policy: Optional[MixedPrecisionPolicy] = None,  # or torch's
                offload_policy: Optional[CPUOffloadPolicy] = None,  # or torch's
                ignored_params: Optional[Iterable[nn.Parameter]] = None) -> ModuleOrModules:
    """Shard the parameters of ``module`` over ``mesh`` in place.

    Args:
        module: one module, or a list of sibling modules that form one unit
            (unsharded at the first pre-forward among them, resharded after
            the last post-forward).
        mesh: a 1-D ``DeviceMesh`` (full sharding over its ranks) or a 2-D
            one with dims ``(replicate, shard)`` (hybrid sharding: sharded
            within each shard group, replicated across the replicate dim;
            gradients reduce-scattered within, then all-reduced across;
            ``(world, 1)`` is pure replication, like DDP); default: a 1-D
            mesh over every rank of the default process group, on CUDA when
            the backend is NCCL, else on CPU. Must be the same on every rank
            for a model (state dicts place values on it).
        reshard_after_forward: free the unsharded parameters after forward
            and all-gather them again for backward. ``None`` (default): every
            unit but the root (whose backward starts right after forward);
            ``True``: the root too; ``False``: keep them until backward. An
            int ``k`` dividing the shard group size ``F``: keep them sharded
            over groups of ``k`` consecutive ranks between forward and
            backward (each rank holds ``1/k`` of them; backward gathers
            from ``k`` ranks only, e.g. within a node); ``F`` is ``True``
            and ``1`` is ``False``.
        mp_policy: compute/communicate in lower precision for this unit
            (see :class:`MixedPrecisionPolicy`); ``None``: full precision.
            torch's ``torch.distributed.fsdp.MixedPrecisionPolicy`` is
            accepted too (converted field by field, ``torch_policies.py``).
        offload_policy: keep this unit's shards, gradients and optimizer
            state on the CPU (see :class:`CPUOffloadPolicy`); torch's
            ``CPUOffloadPolicy`` and ``OffloadPolicy`` (no offloading) are
            accepted too.
        ignored_params: parameters left alone: not sharded, not reduced.

    Returns:
        ``module`` itself, whose class now also derives from
        :class:`ShardedModule`. Parameters keep their identity and FQNs; each
        one's ``.data`` becomes the 1-D slice of the flat shard this rank owns.

    Raises:
        ValueError / RuntimeError naming the module or parameter and the fix,
        for misuse (see ``docs/design.md`` section 6).
    """
    modules = _as_module_list(module)
    check_reshard_after_forward(reshard_after_forward)
    mp_policy = as_mp_policy(mp_policy)  # torch FSDP2's policy objects are converted
    offload_policy = as_offload_policy(offload_policy)
    for m in modules:
        if state_of(m) is not None:
            raise ValueError(
                f"{type(m).__name__} module is already annotated by fully_shard; call "
                "fully_shard once per module (use a list for several siblings as one unit).")
    check_not_replicated(modules)
    if mesh is not None:
        _check_rank_in_mesh(mesh, modules[0])
    group = shard_group_from_mesh(mesh if mesh is not None else default_mesh())
    ignored = _ignored_set(ignored_params)
    managed = _managed_modules(modules)
    records = _collect_records(modules, managed, ignored)
    _localize_tensor_parallel(records, group, mp_policy, offload_policy)
    _check_params(records, group.device)
    unit = ShardUnit(modules, managed, _group_records(records), group, reshard_after_forward,
                     mp_policy, offload_policy)
    if mp_policy is not None and mp_policy.buffer_dtype is not None:
        _cast_buffers(managed, mp_policy.buffer_dtype)
    register_owner(unit)
    UnitStateDictHooks(unit)
    register_unit(module, unit)
    link_annotated_below(state_of(modules[0]))
    install_step_guard()
    torch_norms.install()  # torch's clip_grad_norm_ / get_total_norm: global over shards
    for m in modules:
        m.__class__ = _sharded_class(type(m))
    if len(modules) == 1:
        _rename_below(modules[0])
    return module


def param_info(param: nn.Parameter) -> Optional[ShardedParamInfo]:
    """Original FQN and shape of a parameter sharded by ``fully_shard``
    (``None`` for a parameter it does not manage). Use it where code looks at
    ``param.ndim`` or names, e.g. to build weight-decay param groups."""
    entry = owner_of(param)
    if entry is None:
        return None
    buffer, index = entry.buffer, entry.index
    record = buffer.records[index]
    local = buffer.local_slices()[index]
    return ShardedParamInfo(fqn=record.fqn, shape=record.shape, numel=record.shape.numel(),
                            local_numel=local.length, local_offset=local.param_start)


def flat_buffer_of(param: nn.Parameter) -> Optional[FlatBuffer]:
    """The flat buffer that manages ``param`` (for tests and tools)."""
    entry = owner_of(param)
    return None if entry is None else entry.buffer


# ----------------------------------------------------------------- helpers
def _as_module_list(module: ModuleOrModules) -> list[nn.Module]:
    modules = [module] if isinstance(module, nn.Module) else list(module)
    if not modules:
        raise ValueError("fully_shard needs a module or a non-empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard takes nn.Module objects, got {type(m).__name__}")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"fully_shard got an nn.{type(m).__name__}, a container whose forward never runs, "
                "so its parameters would never be all-gathered. Annotate its children instead "
                "(for block in blocks: fully_shard(block)), or pass them as a list to form one "
                "unit (fully_shard(list(blocks))).")
    return modules


def _check_rank_in_mesh(mesh: object, module: nn.Module) -> None:
    """A mesh built over ranks that exclude this one has no group here
    (torch would fail later, deep inside, with an unrelated message)."""
    if isinstance(mesh, DeviceMesh) and mesh.get_coordinate() is None:
        raise ValueError(
            f"fully_shard({type(module).__name__}) got a mesh over ranks "
            f"{mesh.mesh.flatten().tolist()}, which does not include this rank "
            f"({torch.distributed.get_rank()}). Call fully_shard with a mesh only on the ranks "
            "it contains, or build the mesh over every rank that trains this module "
            "(init_device_mesh(device_type, (world_size,))).")


def _ignored_set(ignored_params: Optional[Iterable[nn.Parameter]]) -> set[int]:
    ignored = set()
    for p in ignored_params or ():
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"ignored_params must hold nn.Parameter objects, got {type(p).__name__}")
        ignored.add(id(p))
    return ignored


def _managed_modules(modules: list[nn.Module]) -> list[nn.Module]:
    """The given modules and their descendants, minus the subtrees of
    modules annotated before (they own their parameters already)."""
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
            if state_of(child) is None and not is_replicated(child):  # replicate() owns those
                stack.append(child)
    return managed


def _module_names(modules: list[nn.Module]) -> dict[int, str]:
    names: dict[int, str] = {}
    for i, top in enumerate(modules):
        prefix = f"[{i}]." if len(modules) > 1 else ""
        for name, sub in top.named_modules(remove_duplicate=False):
            names.setdefault(id(sub), (prefix + name).rstrip("."))
    return names


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _collect_records(modules: list[nn.Module], managed: list[nn.Module],
                     ignored: set[int]) -> list[ParamRecord]:
    names = _module_names(modules)
    records: dict[int, ParamRecord] = {}
    for m in managed:
        for attr, param in m._parameters.items():
            if param is None or id(param) in ignored:
                continue
            fqn = _join(names.get(id(m), ""), attr)
            if id(param) in records:
                records[id(param)].slots.append((m, attr))
                continue
            owner = owner_of(param)
            if owner is not None:
                _raise_already_owned(fqn, owner, m, names)
            records[id(param)] = ParamRecord(param=param, slots=[(m, attr)], fqn=fqn,
                                             shape=param.shape)
    return list(records.values())


def _raise_already_owned(fqn: str, owner: Owner, module: nn.Module,
                         names: dict[int, str]) -> None:
    record = owner.buffer.records[owner.index]
    if any(module is m for m in owner.unit.managed_modules):
        raise ValueError(
            f"parameter '{record.fqn}' (here '{fqn}') is already managed by an earlier "
            f"fully_shard call on an ancestor, {owner.unit.name}. Annotate bottom-up: call "
            "fully_shard on children before their parents.")
    owner_module, owner_attr = record.slots[0]
    other = _join(names[id(owner_module)], owner_attr) if id(owner_module) in names else record.fqn
    raise ValueError(
        f"parameter '{fqn}' is the same tensor as '{other}', which another fully_shard unit "
        f"({owner.unit.name}) already manages (e.g. a tied input embedding and output head). A "
        "shared parameter must live in one unit that is unsharded wherever it is used: annotate "
        "the common ancestor of both modules instead of the module that holds it, or pass it "
        "in ignored_params.")


def _localize_tensor_parallel(records: list[ParamRecord], group, mp_policy, offload_policy) -> None:
    """Replace every tensor-parallel (``DTensor``) parameter by a new plain
    parameter of its TP-local values under the same name(s); the record
    keeps what forward needs to present it as a ``DTensor`` again (see
    ``_tensor_parallel.py``: a DTensor parameter cannot keep its identity)."""
    tp_records = [r for r in records if isinstance(r.param, DTensor)]
    if not tp_records:
        return
    _tensor_parallel.check_policies(tp_records[0].fqn, mp_policy is not None,
                                    offload_policy is not None)
    for r in tp_records:
        r.param, r.tp = _tensor_parallel.localize(r.param, r.fqn, group)
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


def _group_records(records: list[ParamRecord]) -> list[list[ParamRecord]]:
    """One group per (dtype, requires_grad), in order of first appearance, so
    frozen parameters never cost gradient memory or reduce-scatter volume."""
    groups: dict[tuple[torch.dtype, bool], list[ParamRecord]] = {}
    for r in records:
        groups.setdefault((r.param.dtype, r.param.requires_grad), []).append(r)
    return list(groups.values())


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
                record.fqn = _join(names.get(id(module), name), attr)
