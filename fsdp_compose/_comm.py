"""Collectives and the process group a unit shards over.

Everything that talks to ``torch.distributed`` for the data path lives here,
so the rest of the package never names a backend. The same functions run on
CPU/gloo and CUDA/NCCL.

The collectives never copy: the all-gather writes straight into the caller's
unsharded buffer, and the reduce-scatter reads straight from the caller's
flat gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# torch >= 2.10 names the flat collectives *_single and deprecates the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class ShardGroup:
    """The ranks one unit shards over, and where it computes.

    Attributes:
        mesh: the 1-D device mesh.
        process_group: its process group (the one all collectives use).
        rank: this process's rank inside ``process_group``.
        world_size: the sharding factor ``F``.
        device: the compute device (CUDA for NCCL meshes, CPU otherwise).
    """

    mesh: DeviceMesh
    process_group: dist.ProcessGroup
    rank: int
    world_size: int
    device: torch.device


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over all ranks of the default process group, on CUDA when
    the backend is NCCL, else on CPU."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed to be initialised: call "
            "torch.distributed.init_process_group(...) first (e.g. run under "
            "torchrun), or pass mesh= explicitly.")
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    world = dist.group.WORLD
    cached = _DEFAULT_MESH.get(device_type)
    if cached is None or cached[0] is not world:  # one mesh per default process group
        _DEFAULT_MESH[device_type] = (world, init_device_mesh(device_type, (dist.get_world_size(),)))
    return _DEFAULT_MESH[device_type][1]


# device type -> (the default process group it was built for, the mesh)
_DEFAULT_MESH: dict[str, tuple[object, DeviceMesh]] = {}


def shard_group_from_mesh(mesh: DeviceMesh) -> ShardGroup:
    """Validate ``mesh`` and describe it as a :class:`ShardGroup`."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"fully_shard got a {mesh.ndim}-D mesh {tuple(mesh.shape)}; only 1-D meshes are "
            "supported so far (hybrid sharding over a 2-D mesh is planned). Pass a 1-D mesh, "
            "e.g. init_device_mesh(device_type, (world_size,)).")
    group = mesh.get_group()
    if mesh.device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(mesh.device_type)
    return ShardGroup(mesh=mesh, process_group=group, rank=group.rank(),
                      world_size=group.size(), device=device)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group: ShardGroup,
                    async_op: bool = False) -> Optional[dist.Work]:
    """All-gather ``shard`` from every rank into ``output`` (``F`` times its
    size, rank-major). Returns the work handle when ``async_op``."""
    return _all_gather_flat(output, shard, group=group.process_group, async_op=async_op)


def reduce_scatter_mean(output: torch.Tensor, flat: torch.Tensor, group: ShardGroup,
                        async_op: bool = False) -> Optional[dist.Work]:
    """Reduce-scatter ``flat`` (``F`` times ``output``'s size) with the mean
    over ranks, leaving this rank's chunk in ``output``."""
    return _reduce_scatter_flat(output, flat, op=dist.ReduceOp.AVG,
                                group=group.process_group, async_op=async_op)


def all_gather_fingerprints(fingerprint: int, group: ShardGroup) -> list[int]:
    """Every rank's 63-bit ``fingerprint``, in rank order (one tiny all-gather)."""
    mine = torch.tensor([fingerprint], dtype=torch.int64, device=group.device)
    every = torch.empty(group.world_size, dtype=torch.int64, device=group.device)
    _all_gather_flat(every, mine, group=group.process_group)
    return [int(v) for v in every.cpu()]
