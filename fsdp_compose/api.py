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
import weakref

from ._comm import default_mesh, shard_group_from_mesh
from ._compose import check_not_replicated, is_replicated
from ._flat_buffer import FlatBuffer, ParamRecord
from ._state import _ShardState, register_unit, state_of
from ._schedule import PrefetchPolicy
from ._unit import ShardUnit
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy

ModuleOrModules = Union[nn.Module, Sequence[nn.Module]]

# id(original parameter) -> the unit that manages it. Weak in the unit (a
# dropped model releases its entries) and not a weak reference to the
# parameter, which would stop torch.utils.swap_tensors (module.to() with
# swap_module_params_on_conversion). The unit holds the parameter, so while
# an entry lives its id cannot be reused.
_OWNERS: "weakref.WeakValueDictionary[int, ShardUnit]" = weakref.WeakValueDictionary()


class _Owner(NamedTuple):
    unit: ShardUnit
    buffer: FlatBuffer
    index: int


def _owner_of(param: torch.Tensor) -> Optional[_Owner]:
    unit = _OWNERS.get(id(param))
    located = None if unit is None else unit.locate(param)
    return None if located is None else _Owner(unit, *located)


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
                reshard_after_forward: Optional[bool] = None,
                mp_policy: Optional[MixedPrecisionPolicy] = None,
                offload_policy: Optional[CPUOffloadPolicy] = None,
                ignored_params: Optional[Iterable[nn.Parameter]] = None) -> ModuleOrModules:
    """Shard the parameters of ``module`` over ``mesh`` in place.

    Args:
        module: one module, or a list of sibling modules that form one unit
            (unsharded at the first pre-forward among them, resharded after
            the last post-forward).
        mesh: a 1-D ``DeviceMesh``; default: every rank of the default
            process group, on CUDA when the backend is NCCL, else on CPU.
        reshard_after_forward: free the unsharded parameters after forward
            and all-gather them again for backward. ``None`` (default): every
            unit but the root (whose backward starts right after forward);
            ``True``: the root too; ``False``: keep them until backward.
        mp_policy: compute/communicate in lower precision for this unit
            (see :class:`MixedPrecisionPolicy`); ``None``: full precision.
        offload_policy: keep this unit's shards, gradients and optimizer
            state on the CPU (see :class:`CPUOffloadPolicy`).
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
    _check_reshard_after_forward(reshard_after_forward)
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if offload_policy is not None and not isinstance(offload_policy, CPUOffloadPolicy):
        raise TypeError(
            f"offload_policy must be a CPUOffloadPolicy, got {type(offload_policy).__name__}")
    for m in modules:
        if state_of(m) is not None:
            raise ValueError(
                f"{type(m).__name__} module is already annotated by fully_shard; call "
                "fully_shard once per module (use a list for several siblings as one unit).")
    check_not_replicated(modules)
    group = shard_group_from_mesh(mesh if mesh is not None else default_mesh())
    ignored = _ignored_set(ignored_params)
    managed = _managed_modules(modules)
    records = _collect_records(modules, managed, ignored)
    _check_params(records, group.device)
    unit = ShardUnit(modules, managed, _group_records(records), group, reshard_after_forward,
                     mp_policy, offload_policy)
    if mp_policy is not None and mp_policy.buffer_dtype is not None:
        _cast_buffers(managed, mp_policy.buffer_dtype)
    for buffer in unit.buffers:
        for record in buffer.records:
            _OWNERS[id(record.param)] = unit
    register_unit(module, unit)
    for m in modules:
        m.__class__ = _sharded_class(type(m))
    if len(modules) == 1:
        _rename_below(modules[0])
    return module


def param_info(param: nn.Parameter) -> Optional[ShardedParamInfo]:
    """Original FQN and shape of a parameter sharded by ``fully_shard``
    (``None`` for a parameter it does not manage). Use it where code looks at
    ``param.ndim`` or names, e.g. to build weight-decay param groups."""
    entry = _owner_of(param)
    if entry is None:
        return None
    buffer, index = entry.buffer, entry.index
    record = buffer.records[index]
    local = buffer.local_slices()[index]
    return ShardedParamInfo(fqn=record.fqn, shape=record.shape, numel=record.shape.numel(),
                            local_numel=local.length, local_offset=local.param_start)


def flat_buffer_of(param: nn.Parameter) -> Optional[FlatBuffer]:
    """The flat buffer that manages ``param`` (for tests and tools)."""
    entry = _owner_of(param)
    return None if entry is None else entry.buffer


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: the all-gathers are in flight;
    ``wait()`` finishes them and switches the modules to the full views."""

    def __init__(self, units: list[ShardUnit]) -> None:
        self._units = units

    def wait(self) -> None:
        for unit in self._units:
            for buffer in unit.buffers:
                buffer.finish_unshard()
        self._units = []


class ShardedModule:
    """Methods mixed into every module annotated by :func:`fully_shard`
    (the module's class becomes a subclass of its own class and this one)."""

    def unshard(self, async_op: bool = False, *, recurse: bool = False) -> Optional[UnshardHandle]:
        """All-gather this unit's parameters (and every unit below it with
        ``recurse=True``); until :meth:`reshard`, each original parameter's
        module attribute holds the full values in the original shape."""
        own = _own_state(self)
        own.lazy_init()
        units = [state.unit for state in _states(self, recurse)]
        for unit in units:
            for buffer in unit.buffers:
                buffer.start_unshard()
        handle = UnshardHandle(units)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self, *, recurse: bool = False) -> None:
        """Free the unsharded parameters; attributes are the sharded
        ``nn.Parameter`` objects again."""
        for state in _states(self, recurse):
            state.unit.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """With ``False``, backward keeps the unsharded flat gradients (no
        collectives) and the next backward with ``True`` reduces their sum."""
        for state in _states(self, recurse):
            state.unit.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """With ``False``, units stay unsharded after backward (saving the
        next forward's all-gather during accumulation). Set it back to
        ``True`` (or call ``reshard()``) before the optimizer step: the
        optimizer updates the shards, not the unsharded copy."""
        for state in _states(self, recurse):
            state.unit.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: Sequence[nn.Module]) -> None:
        """Before this module's forward, issue the all-gathers of ``modules``
        (annotated modules) instead of the one chosen by the recorded order."""
        _own_state(self).unit.forward_prefetch = [_own_state(m).unit for m in modules]

    def set_modules_to_backward_prefetch(self, modules: Sequence[nn.Module]) -> None:
        """When this module's backward starts, issue the all-gathers of
        ``modules`` instead of the one chosen by the recorded order."""
        _own_state(self).unit.backward_prefetch = [_own_state(m).unit for m in modules]

    def set_prefetch_policy(self, policy: PrefetchPolicy) -> None:
        """Set forward/backward prefetch and the in-flight limits for the
        whole model this module belongs to (call it on the root)."""
        if not isinstance(policy, PrefetchPolicy):
            raise TypeError(f"expected a PrefetchPolicy, got {type(policy).__name__}")
        _own_state(self).unit.scheduler.policy = policy

    def set_reshard_after_forward(self, reshard_after_forward: bool, *,
                                  recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` (``True`` makes the root reshard
        after forward too, and all-gather again for backward)."""
        _check_reshard_after_forward(reshard_after_forward)
        for state in _states(self, recurse):
            state.unit.reshard_after_forward = reshard_after_forward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """With ``False``, this unit's backward does not all-gather its
        parameters again: only for units whose backward reads no parameter
        values, e.g. an ``nn.Embedding`` (its weight gradient needs only the
        indices). A forward that saves a parameter for backward raises."""
        _own_state(self).unit.unshard_in_backward = unshard_in_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """With ``False``, the end of backward neither waits for the
        reduce-scatters still in flight nor hands the gradients to the
        parameters: more backwards of this step follow (micro-batches,
        pipeline schedules). Set ``True`` before the step's last backward."""
        for state in _states(self, recurse=True):
            state.unit.is_last_backward = is_last_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduce gradients as the sum over ranks divided by ``factor``
        instead of the mean (``factor=1.0``: summed gradients, for a loss
        that is already normalised globally). Applies to every unit of this
        module's subtree."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be > 0, got {factor}")
        for state in _states(self, recurse=True):
            unit = state.unit
            unit.reduce_options = unit.reduce_options._replace(divide_factor=float(factor))

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """With ``True``, collectives only ever ``SUM`` (the division by the
        world size or the divide factor happens locally afterwards); the
        gradients are the same. Applies to every unit of this subtree."""
        for state in _states(self, recurse=True):
            unit = state.unit
            unit.reduce_options = unit.reduce_options._replace(force_sum=bool(enable))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every parameter of this module by their
        total norm over all ranks, like FSDP1's method (torch's
        ``nn.utils.clip_grad_norm_`` would see only this rank's shards).
        Returns the total norm. See :func:`fsdp_compose.clip_grad_norm_`."""
        from .clip import clip_grad_norm_  # clip.py builds on this module
        return clip_grad_norm_(self, max_norm, norm_type)

    def __new__(cls, *args, **kwargs):
        # Constructing the sharded class (nn.Sequential slicing does
        # ``self.__class__(...)``) gives a plain module of the original class:
        # a fresh module has no fully_shard state.
        original = cls.__mro__[2]  # (Sharded<X>, ShardedModule, X, ...)
        module = original.__new__(original)
        module.__init__(*args, **kwargs)
        return module

    def __copy__(self):
        self.__deepcopy__({})

    def __deepcopy__(self, memo: dict):
        raise TypeError(
            f"cannot copy a {type(self).__name__} annotated by fully_shard: the copy would share "
            "its hooks and flat buffers with the original. Copy the model before fully_shard, "
            "or build a new one and load a state_dict into it.")

    def __reduce_ex__(self, protocol: int):
        raise TypeError(
            f"cannot pickle (torch.save) a {type(self).__name__} annotated by fully_shard: each "
            "rank holds only its shards. Save a state_dict instead (read under "
            "model.unshard(recurse=True)), or copy/save the model before fully_shard.")

    def _apply(self, fn, recurse: bool = True):
        """``module.to(dtype)``, ``.double()``, ``.bfloat16()``, ...: convert
        the shards, and rebuild each unit's flat buffers in the new dtype
        (parameters keep their identity, ``.grad`` follows)."""
        units = [state.unit for state in _states(self, recurse=True)]
        for unit in units:
            unit.reshard()
        result = super()._apply(fn, recurse)  # type: ignore[misc]
        for unit in units:
            unit.adopt_converted_params()
        return result


# ----------------------------------------------------------------- helpers
_SHARDED_CLASSES: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    if issubclass(cls, ShardedModule):
        return cls
    if cls not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedModule, cls),
                                     {"__module__": cls.__module__})
    return _SHARDED_CLASSES[cls]


def _own_state(module: nn.Module) -> _ShardState:
    state = state_of(module)
    if state is None:
        raise AssertionError(f"{type(module).__name__} has no fully_shard state")
    return state


def _states(module: nn.Module, recurse: bool) -> list[_ShardState]:
    if not recurse:
        return [_own_state(module)]
    seen: dict[int, _ShardState] = {}
    for sub in module.modules():
        state = state_of(sub)
        if state is not None:
            seen.setdefault(id(state), state)
    return list(seen.values())


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


def _check_reshard_after_forward(value: object) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        raise NotImplementedError(
            f"reshard_after_forward={value}: resharding to a smaller group after forward is not "
            "supported yet; pass True, False or None.")
    raise TypeError(f"reshard_after_forward must be a bool or None, got {type(value).__name__}")


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
            owner = _owner_of(param)
            if owner is not None:
                _raise_already_owned(fqn, owner, m, names)
            records[id(param)] = ParamRecord(param=param, slots=[(m, attr)], fqn=fqn,
                                             shape=param.shape)
    return list(records.values())


def _raise_already_owned(fqn: str, owner: _Owner, module: nn.Module,
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


def _check_params(records: list[ParamRecord], device: torch.device) -> None:
    """Reject what cannot be sharded, naming the parameter and the fix."""
    devices: dict[torch.device, str] = {}
    for r in records:
        devices.setdefault(r.param.device, r.fqn)
    if len(devices) > 1:
        listing = ", ".join(f"'{fqn}' on {dev}" for dev, fqn in devices.items())
        raise ValueError(f"parameters of one fully_shard unit are on different devices ({listing});"
                         " move the module to one device first (module.to(device)).")
    for r in records:
        p = r.param
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"parameter '{r.fqn}' has layout {p.layout}; fully_shard needs dense "
                             "(strided) parameters. Convert it, or pass it in ignored_params.")
        if p.is_meta:
            raise NotImplementedError(
                f"parameter '{r.fqn}' is on the meta device; materialise the module first "
                "(module.to_empty(device=...) and initialise it) before fully_shard.")
        if not p.is_contiguous():
            raise ValueError(f"parameter '{r.fqn}' is not contiguous (strides {p.stride()}); "
                             "make it contiguous (param.data = param.data.contiguous()) before "
                             "fully_shard.")
        if p.device.type not in (device.type, "cpu"):
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
