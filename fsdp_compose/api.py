"""Public API: ``fully_shard`` (argument checking; ``setup/units.py`` builds
the unit) and ``param_info``. An annotated module's methods are in
``module_methods/``.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .setup.units import PlacementFn, check_unit_placement, setup_unit
from .checkpoint import UnitStateDictHooks
from .checkpoint import install_direct_optimizer_state, install_optimizer_layout_hooks
from .checks.empty_groups import install_empty_group_check
from .checks.replicate import check_not_replicated
from .checks.step_guard import install_step_guard
from .checks.unmanaged import install_unmanaged_check, mark_reduced_elsewhere
from .optim import install_default_flat_step
from .comm.groups import data_parallel_mesh, default_mesh, shard_group_from_mesh
from .policies import CommPolicy, CPUOffloadPolicy, MixedPrecisionPolicy
from .runtime.owners import owner_of
from ._naming import user_class_name
from .runtime.state import state_of
from .module_methods.sharded_module import check_reshard_after_forward, sharded_class
from .gradients import torch_norms
from .gradients import torch_zero_grad
from .setup.torch_policies import as_mp_policy, as_offload_policy

ModuleOrModules = Union[nn.Module, Sequence[nn.Module]]

class ShardedParamInfo(NamedTuple):
    """What a sharded parameter was before sharding, and what this rank holds.

    Attributes:
        fqn: original name, relative to the outermost module annotated so far.
        shape, numel: original shape and elements (``param`` is this rank's piece).
        local_numel: elements this rank owns (``param.numel()``).
        local_offset: index of the first owned element in the flattened
            original (``Shard(d)``, ``d > 0``: of ``param.movedim(d, 0)``;
            meaningless when ``local_numel == 0``)."""

    fqn: str
    shape: torch.Size
    numel: int
    local_numel: int
    local_offset: int


def fully_shard(module: ModuleOrModules, *, mesh: Optional[DeviceMesh] = None,
                reshard_after_forward: Union[bool, int, None] = None,
                mp_policy: Optional[MixedPrecisionPolicy] = None,  # or torch's
                offload_policy: Optional[CPUOffloadPolicy] = None,  # or torch's
                ignored_params: Optional[Iterable[nn.Parameter]] = None,
                placement: object = None,
                shard_placement_fn: Optional[PlacementFn] = None,
                dp_mesh_dims: Optional[object] = None,
                comm_policy: Optional[CommPolicy] = None) -> ModuleOrModules:
    """Shard the parameters of ``module`` over ``mesh`` in place.

    Args:
        module: one module, or a list of sibling modules forming one unit.
        mesh: a 1-D ``DeviceMesh`` (full sharding) or a 2-D one with dims
            ``(replicate, shard)`` (hybrid: reduce-scattered within a shard
            group, all-reduced across). Default: 1-D over the default group,
            on CUDA when the parameters are or the backend is NCCL, else on
            CPU. The same on every rank for a model.
        reshard_after_forward: free the unsharded parameters after forward
            and gather them again for backward. ``None`` (default): every unit
            but the root; ``True``: the root too; ``False``: keep them until
            backward; an int ``k`` dividing the shard group size: keep them
            sharded over ``k`` consecutive ranks in between.
        mp_policy: :class:`MixedPrecisionPolicy` (or torch's); ``None``: full
            precision.
        offload_policy: :class:`CPUOffloadPolicy` (or torch's) keeps shards,
            gradients and optimizer state on the CPU.
        ignored_params: parameters neither sharded nor reduced (see
            :func:`mark_reduced_elsewhere`).
        placement: where rank boundaries may fall (``docs/placements.md``):
            ``None`` (default): ``"rows"``, or ``"flat"`` where whole rows
            would pad over 1% more and for 0-dim parameters; ``"rows"``
            (pieces ``(rows_here, *rest)``); ``"flat"`` (1-D pieces);
            ``Blocks(n)``; ``"owned"`` (each parameter whole on one rank);
            FSDP2's ``Shard(dim)``.
        shard_placement_fn: FSDP2's hook: called with each parameter, returns
            a placement, ``None`` for ``placement``, or :class:`OnMesh`
            ``(mesh, placement)`` (or FSDP2's ``ShardPlacementResult``) to
            shard it over another mesh in a buffer of its own.
        dp_mesh_dims: FSDP2's: ``mesh`` is the whole SPMD mesh and these dims
            (torch's ``DataParallelMeshDims``) the data-parallel ones; every
            parameter is a ``DTensor`` on it, ``Replicate()`` on those dims.
        comm_policy: block-wise int8/fp8 quantized collectives
            (:class:`CommPolicy`); ``None``: exact.

    Returns:
        ``module`` itself, now also a :class:`ShardedModule`. Parameters keep
        their identity and FQNs; each ``.data`` becomes this rank's piece.

    Raises:
        TypeError, ValueError, RuntimeError naming the module or parameter and
        the fix (``docs/errors.md``)."""
    modules = _as_module_list(module)
    check_reshard_after_forward(reshard_after_forward)
    mp_policy = as_mp_policy(mp_policy)  # torch FSDP2's policies converted
    offload_policy = as_offload_policy(offload_policy)
    if comm_policy is not None and not isinstance(comm_policy, CommPolicy):
        raise TypeError("comm_policy must be a fsdp_compose.CommPolicy or None, got "
                        f"{type(comm_policy).__name__}")
    for m in modules:
        if state_of(m) is not None:
            raise ValueError(
                f"{user_class_name(m)} module is already annotated by fully_shard; call "
                "fully_shard once per module (use a list for several siblings as one unit).")
    check_unit_placement(placement)
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError("shard_placement_fn must be a callable taking a parameter and returning "
                        f"a placement or None, got {type(shard_placement_fn).__name__}")
    check_not_replicated(modules)
    if mesh is not None:
        _check_rank_in_mesh(mesh, modules[0])
    spmd_mesh = None
    if dp_mesh_dims is not None:
        spmd_mesh, mesh = mesh, data_parallel_mesh(mesh, dp_mesh_dims)
    group = shard_group_from_mesh(mesh if mesh is not None
                                  else default_mesh(_params_device(modules)))
    ignored_params = list(ignored_params or ())
    unit = setup_unit(module, modules, group, _ignored_set(ignored_params),
                      reshard_after_forward, mp_policy, offload_policy, placement,
                      shard_placement_fn, spmd_mesh, comm_policy)
    UnitStateDictHooks(unit)
    mark_reduced_elsewhere(ignored_params)  # the first step does not refuse them
    _install_process_wide_changes()
    for m in modules:
        m.__class__ = sharded_class(type(m))
    return module


def param_info(param: nn.Parameter) -> Optional[ShardedParamInfo]:
    """Original FQN and shape of a parameter sharded by ``fully_shard``
    (``None`` if unmanaged), for code reading ``param.ndim`` or names."""
    entry = owner_of(param)
    if entry is None:
        return None
    buffer, index = entry.buffer, entry.index
    record = buffer.records[index]
    local = buffer.local_slices()[index]
    return ShardedParamInfo(fqn=record.fqn, shape=record.shape, numel=record.shape.numel(),
                            local_numel=local.length, local_offset=local.param_start)


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


def _install_process_wide_changes() -> None:
    """Every change made to the process beyond the annotated modules, each
    once, at the first ``fully_shard``."""
    torch_norms.install()
    torch_zero_grad.install()
    install_optimizer_layout_hooks()
    install_step_guard()
    install_unmanaged_check()
    install_empty_group_check()
    install_direct_optimizer_state()
    install_default_flat_step()


def _params_device(modules: list[nn.Module]) -> Optional[torch.device]:
    for m in modules:
        for p in m.parameters():
            return p.device
    return None


def _check_rank_in_mesh(mesh: object, module: nn.Module) -> None:
    """Refuse a mesh that excludes this rank (torch would fail later, obscurely)."""
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
