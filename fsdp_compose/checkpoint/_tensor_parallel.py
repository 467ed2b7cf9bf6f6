"""The state-dict form of tensor-parallel parameters: this rank's chunk of the
TP-local tensor as a ``DTensor`` on the (dp, tp) mesh, and back.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor

from .._torch_private import StridedShard
from ..buffers.tensor_parallel import TensorParallelSpec


def checkpoint_value(chunk: torch.Tensor, spec: TensorParallelSpec) -> DTensor:
    return DTensor.from_local(chunk, spec.checkpoint_mesh, spec.checkpoint_placements,
                              run_check=False, shape=spec.shape, stride=spec.stride)


def shard_dim_layout(spec: TensorParallelSpec, dim: int) -> tuple[DeviceMesh,
                                                                  tuple[Placement, ...]]:
    """The state-dict mesh and placements of a TP parameter placed
    ``Shard(dim)``: dp's ``Shard(dim)``, or ``_StridedShard(dim,
    split_factor=tp)`` where TP splits ``dim`` too."""
    placements = list(spec.checkpoint_placements)
    if spec.tp_mesh is None:  # an SPMD parameter replicated on its other dim
        placements[-1] = Shard(dim)
        return spec.checkpoint_mesh, tuple(placements)
    tp_placement = placements[-1]
    splits_too = isinstance(tp_placement, Shard) and tp_placement.dim == dim
    placements[-2] = StridedShard(dim, split_factor=spec.tp_mesh.size()) if splits_too \
        else Shard(dim)
    return spec.checkpoint_mesh, tuple(placements)


def local_chunk(value: DTensor, spec: TensorParallelSpec) -> Optional[torch.Tensor]:
    """This rank's chunk where ``value`` has exactly the checkpoint layout, else ``None``."""
    if value.device_mesh == spec.checkpoint_mesh and \
            tuple(value.placements) == spec.checkpoint_placements:
        return value.to_local()
    return None


def tp_local_value(value: torch.Tensor, spec: TensorParallelSpec) -> torch.Tensor:
    """The TP-local part of a checkpoint value in any other form (a ``DTensor`` elsewhere is
    gathered first: collective)."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return distribute_tensor(value.detach(), spec.mesh, spec.placements,
                             src_data_rank=None).to_local()


def refuse_full_load(fqn: str) -> None:
    raise NotImplementedError(
        f"parameter '{fqn}' is tensor-parallel; loading whole weights into it "
        "(scatter_full_state_dict / safetensors) is not supported. Load a state dict with "
        "model.load_state_dict() or torch.distributed.checkpoint.state_dict.set_state_dict().")
