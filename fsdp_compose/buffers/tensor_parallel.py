"""Composition with tensor parallelism: data-parallel sharding over ``mesh["dp"]`` of
``DTensor`` parameters on ``mesh["tp"]``. The flat buffers hold the TP-local tensors and the
original names register plain parameters between iterations (build the optimizer after
``fully_shard``); forward sees a ``DTensor`` again, so TP's collectives run as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from .._torch_private import StridedShard, concatenate_meshes, local_tensor
from ..comm.groups import ShardGroup


@dataclass(frozen=True)
class TensorParallelSpec:
    """What a tensor-parallel parameter was, so that forward can see it again.

    Attributes:
        mesh: the mesh of forward's ``DTensor`` (with ``dp_mesh_dims``: the
            whole SPMD mesh); ``placements``: its placements there.
        tp_mesh: the 1-D mesh its pieces are split over (``None``: replicated).
        dp_dims: ``mesh``'s data-parallel dims (SPMD only).
        shape, stride: global.
        checkpoint_mesh, checkpoint_placements: FSDP2's state-dict layout."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    checkpoint_mesh: DeviceMesh
    checkpoint_placements: tuple[Placement, ...]
    tp_mesh: Optional[DeviceMesh] = None
    dp_dims: frozenset[int] = frozenset()

    @property
    def is_sharded(self) -> bool:
        return any(p.is_shard() for p in self.placements)


def localize(param: nn.Parameter, fqn: str, group: ShardGroup,
             spmd_mesh: Optional[DeviceMesh] = None) -> tuple[nn.Parameter, TensorParallelSpec]:
    """A plain parameter holding ``param``'s TP-local values, and its spec. Raises, naming
    ``fqn``, for unsupported combinations."""
    if not isinstance(param, DTensor):
        raise AssertionError(f"'{fqn}' is not a DTensor parameter")
    if spmd_mesh is not None:
        return _localize_spmd(param, fqn, group, spmd_mesh)
    tp_mesh = param.device_mesh
    dp_mesh = group.mesh
    if tp_mesh.ndim != 1:
        raise NotImplementedError(
            f"parameter '{fqn}' is a DTensor on a {tp_mesh.ndim}-D mesh; fully_shard supports "
            "tensor-parallel parameters on a 1-D mesh (parallelize_module(module, mesh['tp'], "
            "plan)).")
    if tp_mesh == dp_mesh:
        raise ValueError(
            f"parameter '{fqn}' is a DTensor on the same mesh fully_shard shards over; a "
            "parameter can be sharded over a mesh dim once. Build a 2-D mesh "
            "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), parallelize over "
            "mesh['tp'] and fully_shard over mesh['dp'].")
    if any(not (p.is_shard() or p.is_replicate()) for p in param.placements):
        raise NotImplementedError(
            f"parameter '{fqn}' has placements {param.placements}; fully_shard supports "
            "Shard and Replicate tensor-parallel parameters.")
    checkpoint_mesh, placements = _checkpoint_layout(fqn, dp_mesh, tp_mesh, param.placements[0])
    spec = TensorParallelSpec(mesh=tp_mesh, placements=tuple(param.placements),
                              shape=param.shape, stride=tuple(param.stride()),
                              checkpoint_mesh=checkpoint_mesh, checkpoint_placements=placements,
                              tp_mesh=tp_mesh)
    return _local_parameter(param), spec


def _local_parameter(param: DTensor) -> nn.Parameter:
    local = param.to_local().detach()
    if not local.is_contiguous():
        local = local.contiguous()
    return nn.Parameter(local, requires_grad=param.requires_grad)


def _localize_spmd(param: DTensor, fqn: str, group: ShardGroup,
                   spmd_mesh: DeviceMesh) -> tuple[nn.Parameter, TensorParallelSpec]:
    """``dp_mesh_dims``: ``param`` is ``Replicate()`` on the data-parallel dims
    and split over at most one other."""
    if param.device_mesh != spmd_mesh:
        raise ValueError(
            f"parameter '{fqn}' is a DTensor on {param.device_mesh}, not on the mesh passed to "
            f"fully_shard with dp_mesh_dims ({spmd_mesh}); with dp_mesh_dims every parameter "
            "lives on that whole SPMD mesh (distribute_module / distribute_tensor over it).")
    names = spmd_mesh.mesh_dim_names
    dp_names = group.mesh.mesh_dim_names
    dp_dims = frozenset(names.index(n) for n in dp_names)
    placements = tuple(param.placements)
    split = [i for i in dp_dims if not placements[i].is_replicate()]
    if split:
        raise ValueError(
            f"parameter '{fqn}' has placement {placements[split[0]]} on the data-parallel dim "
            f"'{names[split[0]]}'; with dp_mesh_dims its placements there must be Replicate() "
            "(fully_shard shards it over those dims itself).")
    others = [i for i in range(len(names)) if i not in dp_dims]
    if len(others) > 1:
        raise NotImplementedError(
            f"parameter '{fqn}' lives on an SPMD mesh with {len(others)} model-parallel dims "
            f"({[names[i] for i in others]}); fully_shard with dp_mesh_dims supports one "
            "(tensor or expert parallel) besides the data-parallel ones.")
    if any(not (placements[i].is_shard() or placements[i].is_replicate()) for i in others):
        raise NotImplementedError(
            f"parameter '{fqn}' has placements {placements}; fully_shard supports Shard and "
            "Replicate on the model-parallel dim.")
    tp_mesh = spmd_mesh[names[others[0]]] if others else None
    if tp_mesh is None:
        checkpoint_mesh = group.mesh
        checkpoint: tuple[Placement, ...] = (Replicate(),) * (group.mesh.ndim - 1) + (Shard(0),)
    else:
        checkpoint_mesh, checkpoint = _checkpoint_layout(fqn, group.mesh, tp_mesh,
                                                         placements[others[0]])
    spec = TensorParallelSpec(mesh=spmd_mesh, placements=placements, shape=param.shape,
                              stride=tuple(param.stride()), checkpoint_mesh=checkpoint_mesh,
                              checkpoint_placements=checkpoint, tp_mesh=tp_mesh,
                              dp_dims=dp_dims)
    return _local_parameter(param), spec


def _checkpoint_layout(fqn: str, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh,
                       tp_placement: Placement) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The state-dict mesh and placements of a TP (or EP) parameter, as FSDP2's:
    dp ``_StridedShard(0, split_factor=tp)`` where TP shards dim 0 too, else
    ``Shard(0)``."""
    def refuse(why: str) -> ValueError:
        return ValueError(
            f"parameter '{fqn}' is a DTensor on a mesh that cannot be combined with the data-"
            f"parallel mesh ({why}); slice both from one mesh: init_device_mesh(device, (dp, tp), "
            "mesh_dim_names=('dp', 'tp')), then mesh['tp'] for parallelize_module and mesh['dp'] "
            "for fully_shard (for hybrid sharding: a (dp_replicate, dp_shard, tp) mesh and "
            "mesh['dp_replicate', 'dp_shard']), or carve both from one world mesh with "
            "world._unflatten(0, sizes, names).")
    if dp_mesh.mesh_dim_names is None or _single_name(tp_mesh) is None:
        raise refuse("a mesh without dim names")
    try:
        mesh = concatenate_meshes([dp_mesh, tp_mesh])
    except RuntimeError as exc:
        raise refuse(str(exc)) from exc
    dp_placement: Placement = Shard(0)
    if isinstance(tp_placement, Shard) and tp_placement.dim == 0:
        dp_placement = StridedShard(0, split_factor=tp_mesh.size())
    return mesh, (Replicate(),) * (dp_mesh.ndim - 1) + (dp_placement, tp_placement)


def _single_name(mesh: DeviceMesh) -> Optional[str]:
    names = mesh.mesh_dim_names
    return names[0] if names is not None and len(names) == 1 else None


def as_dtensor(view: torch.Tensor, spec: TensorParallelSpec) -> DTensor:
    """The ``DTensor`` forward sees over the TP-local ``view`` (differentiable)."""
    if spec.dp_dims:
        return _SpmdView.apply(view, spec)
    return DTensor.from_local(view, spec.mesh, spec.placements, run_check=False,
                              shape=spec.shape, stride=spec.stride)


class _SpmdView(torch.autograd.Function):
    """``DTensor.from_local`` whose backward leaves the data-parallel dims as
    they come (the reduce-scatter sums them), as FSDP2."""

    @staticmethod
    def forward(ctx, view: torch.Tensor, spec: TensorParallelSpec) -> DTensor:
        ctx.spec = spec
        return DTensor.from_local(view, spec.mesh, spec.placements, run_check=False,
                                  shape=spec.shape, stride=spec.stride)

    @staticmethod
    def backward(ctx, grad: DTensor):
        spec = ctx.spec
        if hasattr(grad, "wait"):  # an AsyncCollectiveTensor
            grad = grad.wait()
        target = tuple(grad.placements[i] if i in spec.dp_dims else p
                       for i, p in enumerate(spec.placements))
        if target != tuple(grad.placements):
            grad = grad.redistribute(placements=target)
        return local_tensor(grad), None


def norm_process_group(spec: Optional[TensorParallelSpec]) -> Optional[dist.ProcessGroup]:
    """The extra group a gradient norm sums over (the tp group of a TP-sharded parameter)."""
    if spec is None or not spec.is_sharded or spec.tp_mesh is None:
        return None
    return spec.tp_mesh.get_group()
