
from __future__ import annotations

import atexit
import gc
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .._torch_private import forget_mesh_groups


@dataclass(frozen=True)
class ShardGroup:
    """The ranks one unit shards (HSDP: and replicates) over, and where it computes.

    Attributes:
        process_group: held weakly (a model outliving ``destroy_process_group()``
            must not keep its threads).
        world_size: ``F``.
        replicate_size: ``R``.
        key: ``id`` of the shard process group, read without resolving the
            weak reference (units over one group share it)."""

    mesh: DeviceMesh
    _process_group: "weakref.ref[dist.ProcessGroup]"
    rank: int
    world_size: int
    device: torch.device
    _replicate_group: Optional["weakref.ref[dist.ProcessGroup]"] = None
    replicate_size: int = 1
    key: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", id(self.process_group))

    @property
    def process_group(self) -> dist.ProcessGroup:
        return _alive(self._process_group)

    @property
    def replicate_process_group(self) -> Optional[dist.ProcessGroup]:
        return None if self._replicate_group is None else _alive(self._replicate_group)

    @property
    def total_size(self) -> int:
        return self.world_size * self.replicate_size

    @property
    def is_hybrid(self) -> bool:
        return self.mesh.ndim == 2


def _alive(ref: "weakref.ref[dist.ProcessGroup]") -> dist.ProcessGroup:
    group = ref()
    if group is None:
        raise RuntimeError(
            "the process group of this fully_shard unit was destroyed "
            "(torch.distributed.destroy_process_group()); annotate a new model after "
            "init_process_group.")
    return group


def default_mesh(param_device: Optional[torch.device] = None) -> DeviceMesh:
    """A 1-D mesh over the default process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed to be initialised: call "
            "torch.distributed.init_process_group(...) first (e.g. run under "
            "torchrun), or pass mesh= explicitly.")
    on_cuda = param_device is not None and param_device.type == "cuda"
    device_type = "cuda" if on_cuda or dist.get_backend() == "nccl" else "cpu"
    world = dist.group.WORLD
    cached = _DEFAULT_MESH.get(device_type)
    if cached is None or cached[0]() is not world:
        _DEFAULT_MESH[device_type] = (weakref.ref(world),
                                      init_device_mesh(device_type, (dist.get_world_size(),)))
    return _DEFAULT_MESH[device_type][1]


def backend_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_DEFAULT_MESH: dict[str, tuple["weakref.ref[dist.ProcessGroup]", DeviceMesh]] = {}

_MESHES: "weakref.WeakSet[DeviceMesh]" = weakref.WeakSet()
_EXIT_HOOK: list = []


# [Note: process groups at exit]
# Destroyed gloo groups cached by meshes would live into interpreter finalization, which can abort:
# at exit our meshes drop them.
def _release_destroyed_groups() -> None:
    if not dist.is_available() or dist.is_initialized():
        return
    gc.collect()
    meshes = list(_MESHES) + [mesh for _, mesh in _DEFAULT_MESH.values()]
    _DEFAULT_MESH.clear()
    for mesh in meshes:
        forget_mesh_groups(mesh)


def shard_group_from_mesh(mesh: DeviceMesh) -> ShardGroup:
    """Validate a 1-D or ``(replicate, shard)`` mesh."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard got a {mesh.ndim}-D mesh {tuple(mesh.shape)}; pass a 1-D mesh "
            "(full sharding) or a 2-D (replicate, shard) mesh (hybrid sharding), e.g. "
            "init_device_mesh(device_type, (num_replicas, shard_size), "
            "mesh_dim_names=('replicate', 'shard')). For tensor parallelism, pass the data-"
            "parallel sub-mesh: mesh['dp'], or mesh['dp_replicate', 'dp_shard'] for HSDP x TP on "
            "a (dp_replicate, dp_shard, tp) mesh.")
    group = mesh.get_group(mesh.ndim - 1)
    replicate = mesh.get_group(0) if mesh.ndim == 2 else None
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(atexit.register(_release_destroyed_groups))  # once
    _MESHES.add(mesh)
    if mesh.device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(mesh.device_type)
    return ShardGroup(mesh=mesh, _process_group=weakref.ref(group), rank=group.rank(),
                      world_size=group.size(), device=device,
                      _replicate_group=None if replicate is None else weakref.ref(replicate),
                      replicate_size=1 if replicate is None else replicate.size())


def data_parallel_mesh(mesh: DeviceMesh, dp_mesh_dims: object) -> DeviceMesh:
    """The sub-mesh ``dp_mesh_dims`` names."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError("dp_mesh_dims needs mesh= (the whole SPMD DeviceMesh), got "
                        f"{type(mesh).__name__}")
    names = mesh.mesh_dim_names or ()
    chosen = []
    for role in ("replicate", "shard"):
        value = getattr(dp_mesh_dims, role, None)
        value = (value,) if isinstance(value, str) else tuple(value or ())
        if len(value) > 1:
            raise NotImplementedError(
                f"dp_mesh_dims.{role}={value}: several dims flattened into one is not "
                "supported; flatten them on the mesh first (mesh[names]._flatten(name)) and "
                "name the flattened dim.")
        chosen += list(value)
    if not getattr(dp_mesh_dims, "shard", None) and not getattr(dp_mesh_dims, "replicate", None):
        raise ValueError("dp_mesh_dims names no dim: set shard (and replicate for HSDP)")
    unknown = [n for n in chosen if n not in names]
    if unknown:
        raise ValueError(f"dp_mesh_dims names {unknown}, which are not dims of the mesh "
                         f"(its dims: {list(names)})")
    if getattr(dp_mesh_dims, "shard", None) is None:
        raise NotImplementedError("dp_mesh_dims with replicate only (DDP over the SPMD mesh) is "
                                  "not supported; name a shard dim (of size 1 for no sharding).")
    return mesh[tuple(chosen)] if len(chosen) > 1 else mesh[chosen[0]]


def post_forward_group(group: ShardGroup, size: int) -> ShardGroup:
    """This rank's ``size`` consecutive ranks; cached."""
    if size < 1 or group.world_size % size:
        raise AssertionError(f"post-forward group size {size} must divide {group.world_size}")
    ranks = dist.get_process_group_ranks(group.process_group)
    start = group.rank // size * size
    members = tuple(ranks[start:start + size])
    cached = _POST_FORWARD_GROUPS.get(members)
    subgroup = None if cached is None else cached()
    if subgroup is None:
        subgroup = dist.new_group(list(members), use_local_synchronization=True)
        _POST_FORWARD_GROUPS[members] = weakref.ref(subgroup)
    return ShardGroup(mesh=group.mesh, _process_group=weakref.ref(subgroup),
                      rank=subgroup.rank(), world_size=size, device=group.device)


_POST_FORWARD_GROUPS: dict[tuple[int, ...], "weakref.ref[dist.ProcessGroup]"] = {}
