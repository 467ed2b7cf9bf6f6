"""Public API: ``fully_shard`` (argument checking; ``setup/units.py`` builds the
unit) and ``param_info``. The methods an annotated module gains are in
``module_methods/``.

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
        fqn: original fully-qualified name, relative to the outermost module
            annotated so far (the root once the whole model is annotated).
        shape: original shape (``param`` itself is its local piece between
            iterations: 1-D under ``"flat"``, ``(rows_here, *rest)`` else).
        numel: original number of elements.
        local_numel: elements of it this rank owns (``param.numel()``).
        local_offset: index, in the flattened original, of the first owned
            element (meaningless when ``local_numel == 0``; for ``Shard(d)``
            with ``d > 0``, in the flattening of ``param.movedim(d, 0)``).
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
                ignored_params: Optional[Iterable[nn.Parameter]] = None,
                placement: object = None,
                shard_placement_fn: Optional[PlacementFn] = None,
                dp_mesh_dims: Optional[object] = None,
                comm_policy: Optional[CommPolicy] = None) -> ModuleOrModules:
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
            the module's parameters are on CUDA (gloo carries CUDA tensors
            too: ranks may share a GPU) or the backend is NCCL, else on CPU.
            Must be the same on every rank for a model (state dicts place
            values on it).
        reshard_after_forward: free the unsharded parameters after forward
            and all-gather them again for backward. ``None`` (default): every
            unit but the root (whose backward starts right after forward);
            ``True``: the root too; ``False``: keep them until backward. An
            int ``k`` dividing the shard group size ``F``: keep them sharded
            over groups of ``k`` consecutive ranks between forward and
            backward (each rank holds ``1/k`` of them; backward gathers
            from ``k`` ranks only, e.g. within a node); ``F`` is ``True``
            and ``1`` is ``False``. Over one rank (no mixed precision or
            offload) the unsharded buffer is the shard itself, so there is
            nothing to free: every setting keeps the unsharded views from
            forward to the post-backward reshard.
        mp_policy: compute/communicate in lower precision for this unit
            (see :class:`MixedPrecisionPolicy`); ``None``: full precision.
            torch's ``torch.distributed.fsdp.MixedPrecisionPolicy`` is
            accepted too (converted field by field, ``setup/torch_policies.py``).
        offload_policy: keep this unit's shards, gradients and optimizer
            state on the CPU (see :class:`CPUOffloadPolicy`); torch's
            ``CPUOffloadPolicy`` and ``OffloadPolicy`` (no offloading) are
            accepted too.
        ignored_params: parameters left alone: not sharded, not reduced
            (the optimizer's first step does not refuse them: see
            :func:`mark_reduced_elsewhere`).
        placement: where rank boundaries may fall in this unit's parameters
            (``docs/placements.md``): ``None`` (default): ``"rows"``, but
            ``"flat"`` for a parameter whose whole rows would pad its buffer
            by over 1% more than ``"flat"`` (``describe()`` names them) and
            for 0-dim ones; ``"rows"`` (whole rows: a local piece is
            ``(rows_here, *rest)``, so ``p.ndim`` is kept as in one
            process); ``"flat"`` (anywhere; local pieces are 1-D), ``Blocks(n)``
            (whole blocks of ``n`` rows), ``"owned"`` (every parameter whole
            on one rank, 0 rows and ``.grad is None`` elsewhere), or FSDP2's
            ``Shard(dim)`` (``torch.chunk`` on ``dim``). Each rank's chunk of
            a buffer stays equal, 16-byte aligned; still one all-gather and
            one reduce-scatter per buffer.
        shard_placement_fn: FSDP2's hook: called once with each parameter
            (a ``DTensor`` for a tensor- or expert-parallel one), returns its
            placement (any of the above), ``None`` for ``placement``, or
            :class:`OnMesh` ``(mesh, placement)`` (or FSDP2's
            ``ShardPlacementResult``) to shard it over another mesh: its own
            flat buffer, whose collectives run on that mesh's group (e.g.
            routed experts over the expert-data-parallel mesh, the rest of
            the block over ``mesh``).

        dp_mesh_dims: FSDP2's: ``mesh`` is the whole SPMD mesh, whose dims
            named by ``dp_mesh_dims.shard`` (and ``.replicate`` for HSDP)
            are the data-parallel ones (torch's ``DataParallelMeshDims``,
            one name each); every parameter is a ``DTensor`` on that mesh,
            ``Replicate()`` on those dims and split over at most one other
            (tensor or expert parallel). Forward sees them on the SPMD mesh;
            each rank's gradient on the data-parallel dims is its own
            contribution, reduced as usual.
        comm_policy: quantize this unit's all-gather and/or gradient
            reduction block-wise to int8 or fp8 (:class:`CommPolicy`;
            ``None``: exact collectives). The sharded values stay exact.

    Returns:
        ``module`` itself, whose class now also derives from
        :class:`ShardedModule`. Parameters keep their identity and FQNs; each
        one's ``.data`` becomes the view of the flat shard this rank owns
        (its local piece under its placement).

    Raises:
        ValueError / RuntimeError naming the module or parameter and the fix,
        for misuse (see ``docs/errors.md``).
    """
    modules = _as_module_list(module)
    check_reshard_after_forward(reshard_after_forward)
    mp_policy = as_mp_policy(mp_policy)  # torch FSDP2's policy objects are converted
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
    mark_reduced_elsewhere(ignored_params)  # left to the user: the first step does not refuse them
    _install_process_wide_changes()
    for m in modules:
        m.__class__ = sharded_class(type(m))
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


def _install_process_wide_changes() -> None:
    """Every change fsdp_compose makes to the process beyond the modules it
    annotates, made (each once) by the first ``fully_shard``: importing the
    package changes nothing.

    * ``torch.nn.utils.clip_grad_norm_`` and ``get_total_norm`` recognise
      sharded parameters and gradients and reduce over the ranks
      (``torch_norms``; ``fsdp_compose.route_torch_grad_norms(False)`` opts
      out);
    * five global optimizer step pre-hooks
      (``torch.optim.optimizer.register_optimizer_step_pre_hook``): the
      checkpoint layout hooks attached at each optimizer's first step
      (``checkpoint/_optim.py``), the step guard (``checks/step_guard.py``),
      the forgotten-root check (``checks/unmanaged.py``), the empty
      param-group check (``checks/empty_groups.py``) and, last, the flat
      optimizer step put on each optimizer at its first step
      (``optim/flat_step.py``; ``fsdp_compose.flat_step(optimizer,
      enabled=False)`` opts out). Each returns at once for an optimizer
      that holds no annotated parameter;
    * ``torch.optim.Optimizer.zero_grad`` also gives back the memory of the
      kept sharded gradients it cleared (``torch_zero_grad``; nothing else
      changes, and nothing at all for an optimizer over no annotated
      parameter);
    * ``torch.distributed.checkpoint.state_dict``'s state initialisation of a
      fresh optimizer makes AdamW's, Adam's and SGD's state directly instead
      of taking a zero step (``checkpoint/_init_state.py``; torch's own
      function for any other optimizer, or one over no annotated parameter).
    """
    torch_norms.install()
    torch_zero_grad.install()
    install_optimizer_layout_hooks()
    install_step_guard()
    install_unmanaged_check()
    install_empty_group_check()
    install_direct_optimizer_state()
    install_default_flat_step()


def _params_device(modules: list[nn.Module]) -> Optional[torch.device]:
    """The device of the first parameter of ``modules`` (None if they have none)."""
    for m in modules:
        for p in m.parameters():
            return p.device
    return None


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
