"""Collectives and the process group a unit shards over.

Everything that talks to ``torch.distributed`` for the data path lives here,
so the rest of the package never names a backend. The same functions run on
CPU/gloo and CUDA/NCCL.

The collectives never copy: the all-gather writes straight into the caller's
unsharded buffer, and the reduce-scatter reads straight from the caller's
flat gradient.
"""

from __future__ import annotations

import weakref
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
        process_group: its process group (the one all collectives use), held
            weakly: ``torch.distributed`` owns it, and a model that outlives
            ``destroy_process_group()`` (torch's state-dict helpers cache
            models) must not keep its threads running into interpreter exit.
        rank: this process's rank inside ``process_group``.
        world_size: the sharding factor ``F``.
        device: the compute device (CUDA for NCCL meshes, CPU otherwise).
    """

    mesh: DeviceMesh
    _process_group: "weakref.ref[dist.ProcessGroup]"
    rank: int
    world_size: int
    device: torch.device

    @property
    def process_group(self) -> dist.ProcessGroup:
        group = self._process_group()
        if group is None:
            raise RuntimeError(
                "the process group of this fully_shard unit was destroyed "
                "(torch.distributed.destroy_process_group()); annotate a new model after "
                "init_process_group.")
        return group


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
    if cached is None or cached[0]() is not world:  # one mesh per default process group
        _DEFAULT_MESH[device_type] = (weakref.ref(world),
                                      init_device_mesh(device_type, (dist.get_world_size(),)))
    return _DEFAULT_MESH[device_type][1]


def backend_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where tensors for collectives over ``group`` (default: the default
    group) must live: the current CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# device type -> (the default process group it was built for, weakly; the mesh)
_DEFAULT_MESH: dict[str, tuple["weakref.ref[dist.ProcessGroup]", DeviceMesh]] = {}


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
    return ShardGroup(mesh=mesh, _process_group=weakref.ref(group), rank=group.rank(),
                      world_size=group.size(), device=device)


class _DoneWork:
    """What a collective over one rank returns: nothing to wait for."""

    def wait(self) -> bool:
        return True


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group: ShardGroup,
                    async_op: bool = False) -> Optional[dist.Work]:
    """All-gather ``shard`` from every rank into ``output`` (``F`` times its
    size, rank-major). Returns the work handle when ``async_op``. Over one
    rank it is a local copy (none at all when ``output`` is ``shard``)."""
    if group.world_size == 1:
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard)
        return _DoneWork() if async_op else None
    return _all_gather_flat(output, shard, group=group.process_group, async_op=async_op)


def reduce_scatter_scaled(output: torch.Tensor, flat: torch.Tensor, group: ShardGroup,
                          divide_factor: Optional[float] = None, force_sum: bool = False,
                          async_op: bool = False) -> Optional[dist.Work]:
    """Reduce-scatter ``flat`` (``F`` times ``output``'s size): this rank's
    chunk of the sum over ranks divided by ``divide_factor`` (``None``: the
    mean, ``F``) lands in ``output``.

    The mean is one ``AVG`` collective unless ``force_sum``; any other factor
    is a ``SUM`` followed by a local division, which :func:`finish_scaling`
    applies once the work is done. Over one rank nothing is communicated.
    """
    if group.world_size == 1:
        if output.data_ptr() != flat.data_ptr():
            output.copy_(flat)
        finish_scaling(output, group, divide_factor, force_sum)
        return _DoneWork() if async_op else None
    op = dist.ReduceOp.SUM if _needs_post_division(group, divide_factor, force_sum) \
        else dist.ReduceOp.AVG
    return _reduce_scatter_flat(output, flat, op=op, group=group.process_group,
                                async_op=async_op)


def finish_scaling(output: torch.Tensor, group: ShardGroup, divide_factor: Optional[float],
                   force_sum: bool) -> None:
    """The local division that completes :func:`reduce_scatter_scaled`
    (a no-op when the collective averaged already)."""
    if group.world_size == 1:
        if divide_factor is not None and divide_factor != 1.0:
            output.div_(divide_factor)
    elif _needs_post_division(group, divide_factor, force_sum):
        factor = group.world_size if divide_factor is None else divide_factor
        if factor != 1.0:
            output.div_(factor)


def _needs_post_division(group: ShardGroup, divide_factor: Optional[float],
                         force_sum: bool) -> bool:
    mean = divide_factor is None or divide_factor == group.world_size
    return force_sum or not mean


def all_reduce_max(tensor: torch.Tensor, group: ShardGroup) -> None:
    """In-place element-wise maximum over the ranks of ``group``."""
    if group.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group.process_group)


def all_gather_fingerprints(fingerprint: int, group: ShardGroup) -> list[int]:
    """Every rank's 63-bit ``fingerprint``, in rank order (one tiny all-gather)."""
    if group.world_size == 1:
        return [fingerprint]
    mine = torch.tensor([fingerprint], dtype=torch.int64, device=group.device)
    every = torch.empty(group.world_size, dtype=torch.int64, device=group.device)
    _all_gather_flat(every, mine, group=group.process_group)
    return [int(v) for v in every.cpu()]


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_counts: list[int],
               input_counts: list[int], group: ShardGroup) -> None:
    """Rank ``r`` sends ``input_counts[j]`` consecutive elements of ``input``
    to each rank ``j`` (in rank order) and receives ``output_counts[r]`` into
    ``output``, rank-major. Over one rank it is a copy. Used by checkpoint
    conversions, not by the training step."""
    if group.world_size == 1:
        output.copy_(input)
        return
    dist.all_to_all_single(output, input, output_split_sizes=output_counts,
                           input_split_sizes=input_counts, group=group.process_group)
