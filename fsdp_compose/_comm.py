"""Collectives and the process group a unit shards over.

Everything that talks to ``torch.distributed`` for the data path lives here,
so the rest of the package never names a backend. The same functions run on
CPU/gloo and CUDA/NCCL.

The collectives never copy their inputs: the all-gather writes straight into
the caller's unsharded buffer, and the reduce-scatter reads straight from the
caller's flat gradient (on gloo it reduces it in place, see [Note: gloo
reduce-scatter as an all-reduce]).
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
    """The ranks one unit shards over (and, for hybrid sharding, the ranks
    it is replicated over), and where it computes.

    A 1-D mesh shards over all its ranks. A 2-D mesh is ``(replicate,
    shard)`` (torch FSDP2's convention for HSDP): the parameters are sharded
    within the shard dim and replicated across the replicate dim; gradients
    are reduce-scattered within the shard group, then all-reduced across
    the replicate group. ``(world, 1)`` is pure replication (DDP-like).

    Attributes:
        mesh: the mesh ``fully_shard`` got (1-D, or 2-D ``(replicate, shard)``).
        process_group: the shard group (all-gather, reduce-scatter), held
            weakly: ``torch.distributed`` owns it, and a model that outlives
            ``destroy_process_group()`` (torch's state-dict helpers cache
            models) must not keep its threads running into interpreter exit.
        rank: this process's rank inside the shard group.
        world_size: the sharding factor ``F`` (size of the shard group).
        device: the compute device (CUDA for NCCL meshes, CPU otherwise).
        replicate_process_group: the replicate group (``None``: 1-D mesh).
        replicate_size: the number of replicas ``R`` (1 for a 1-D mesh).
    """

    mesh: DeviceMesh
    _process_group: "weakref.ref[dist.ProcessGroup]"
    rank: int
    world_size: int
    device: torch.device
    _replicate_group: Optional["weakref.ref[dist.ProcessGroup]"] = None
    replicate_size: int = 1

    @property
    def process_group(self) -> dist.ProcessGroup:
        return _alive(self._process_group)

    @property
    def replicate_process_group(self) -> Optional[dist.ProcessGroup]:
        return None if self._replicate_group is None else _alive(self._replicate_group)

    @property
    def total_size(self) -> int:
        """Every rank that holds a copy of the unit: ``R * F`` (the
        denominator of the mean gradient)."""
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
    """Validate ``mesh`` (1-D, or 2-D ``(replicate, shard)``) and describe it
    as a :class:`ShardGroup`."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard got a {mesh.ndim}-D mesh {tuple(mesh.shape)}; pass a 1-D mesh "
            "(full sharding) or a 2-D (replicate, shard) mesh (hybrid sharding), e.g. "
            "init_device_mesh(device_type, (num_replicas, shard_size), "
            "mesh_dim_names=('replicate', 'shard')). For tensor parallelism, pass the data-"
            "parallel sub-mesh (mesh['dp']).")
    group = mesh.get_group(mesh.ndim - 1)
    replicate = mesh.get_group(0) if mesh.ndim == 2 else None
    if mesh.device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(mesh.device_type)
    return ShardGroup(mesh=mesh, _process_group=weakref.ref(group), rank=group.rank(),
                      world_size=group.size(), device=device,
                      _replicate_group=None if replicate is None else weakref.ref(replicate),
                      replicate_size=1 if replicate is None else replicate.size())


def post_forward_group(group: ShardGroup, size: int) -> ShardGroup:
    """The group of ``size`` consecutive ranks of ``group``'s shard group
    that this rank belongs to: where a unit with ``reshard_after_forward=size``
    keeps its parameters between forward and backward (each rank holds
    ``F / size`` of the ``F`` shards, re-gathered from ``size`` ranks).

    Collective over the members of the new group only (every member must
    call it); groups are cached, so units share them.
    """
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


# global ranks of a post-forward group -> the group (weakly: torch.distributed owns it)
_POST_FORWARD_GROUPS: dict[tuple[int, ...], "weakref.ref[dist.ProcessGroup]"] = {}


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
    """Reduce-scatter ``flat`` (``F`` times ``output``'s size) over the shard
    group: this rank's chunk of the sum (or, for the mean, of the average)
    lands in ``output``.

    The gradient is complete after :func:`all_reduce_replicas` (hybrid
    sharding) and :func:`finish_scaling`: the mean over all ``R * F`` ranks
    when ``divide_factor`` is ``None`` (one ``AVG`` collective per group
    unless ``force_sum``), else the sum divided by ``divide_factor``. Over
    one rank nothing is communicated.
    """
    if group.world_size == 1:
        if output.data_ptr() != flat.data_ptr():
            output.copy_(flat)
        return _DoneWork() if async_op else None
    op = _reduce_op(group, divide_factor, force_sum)
    if _GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE and flat.device.type == "cpu" and \
            dist.get_backend(group.process_group) == "gloo":
        # see [Note: gloo reduce-scatter as an all-reduce]
        work = dist.all_reduce(flat, op=op, group=group.process_group, async_op=True)
        chunk = flat.narrow(0, group.rank * output.numel(), output.numel())
        pending = _ChunkAfterAllReduce(work, output, chunk)
        if async_op:
            return pending
        pending.wait()
        return None
    return _reduce_scatter_flat(output, flat, op=op, group=group.process_group,
                                async_op=async_op)


# [Note: gloo reduce-scatter as an all-reduce]
# Gloo's reduce-scatter copies its whole input into a buffer of its own when
# the work is created (an extra unsharded-gradient-sized allocation per
# reduction in flight) and, on 2 CPU ranks, takes 1.3-3x as long as an
# in-place all-reduce of the same buffer (benchmarks/comm_micro.py). On CPU
# gloo groups the reduce-scatter is therefore an all-reduce of the flat
# gradient in place, after which this rank's chunk is copied out. The chunk
# is bit-identical to gloo's reduce-scatter output (both sum in rank order;
# checked for 2 and 3 ranks, fp32 and bf16, SUM and AVG); the flat gradient
# is the caller's to discard. It moves twice the bytes, which is cheaper
# here because nothing is copied; NCCL's reduce-scatter does not copy, so
# CUDA keeps the real reduce-scatter. Turned off (the portable op, e.g. to
# count collectives by op) with set_gloo_reduce_scatter_via_all_reduce(False).
_GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE = True


def set_gloo_reduce_scatter_via_all_reduce(enabled: bool) -> bool:
    """Whether gradient reductions over CPU/gloo groups all-reduce the flat
    gradient in place and keep this rank's chunk (default ``True``, same
    values, faster and without gloo's copy of the input) instead of calling
    gloo's reduce-scatter. Process-wide; affects reductions issued after
    the call. Returns the previous setting."""
    global _GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE
    previous, _GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE = _GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE, bool(enabled)
    return previous


def gloo_reduce_scatter_via_all_reduce() -> bool:
    """The current setting of :func:`set_gloo_reduce_scatter_via_all_reduce`."""
    return _GLOO_REDUCE_SCATTER_VIA_ALL_REDUCE


class _ChunkAfterAllReduce:
    """The work of a reduce-scatter done as an all-reduce: waiting on it
    waits the all-reduce, then copies this rank's chunk into the output."""

    def __init__(self, work: dist.Work, output: torch.Tensor, chunk: torch.Tensor) -> None:
        self._work: Optional[dist.Work] = work
        self._output = output
        self._chunk = chunk

    def wait(self) -> bool:
        if self._work is None:
            return True  # waited already: the chunk was copied
        self._work.wait()
        self._work = None
        self._output.copy_(self._chunk)
        return True


def all_reduce_replicas(output: torch.Tensor, group: ShardGroup,
                        divide_factor: Optional[float] = None, force_sum: bool = False,
                        async_op: bool = False) -> Optional[dist.Work]:
    """Hybrid sharding: all-reduce a reduce-scattered chunk across the
    replicas (same op as the reduce-scatter). A no-op without replicas."""
    replicate = group.replicate_process_group
    if replicate is None or group.replicate_size == 1:
        return _DoneWork() if async_op else None
    return dist.all_reduce(output, op=_reduce_op(group, divide_factor, force_sum),
                           group=replicate, async_op=async_op)


def finish_scaling(output: torch.Tensor, group: ShardGroup, divide_factor: Optional[float],
                   force_sum: bool) -> None:
    """The local division that completes the reduction (a no-op when the
    collectives averaged already)."""
    if _needs_post_division(group, divide_factor, force_sum):
        factor = group.total_size if divide_factor is None else divide_factor
        if factor != 1.0:
            output.div_(factor)


def _reduce_op(group: ShardGroup, divide_factor: Optional[float],
               force_sum: bool) -> dist.ReduceOp:
    return dist.ReduceOp.SUM if _needs_post_division(group, divide_factor, force_sum) \
        else dist.ReduceOp.AVG


def _needs_post_division(group: ShardGroup, divide_factor: Optional[float],
                         force_sum: bool) -> bool:
    mean = divide_factor is None or divide_factor == group.total_size
    return force_sum or not mean


def all_reduce_max(tensor: torch.Tensor, group: ShardGroup) -> None:
    """In-place element-wise maximum over every rank of ``group``'s mesh
    (the shard group, then the replicas)."""
    if group.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group.process_group)
    replicate = group.replicate_process_group
    if replicate is not None and group.replicate_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=replicate)


def all_gather_fingerprints(fingerprint: int, group: ShardGroup,
                            include_replicas: bool = True) -> list[int]:
    """Every rank's 63-bit ``fingerprint``: the shard group's in rank order,
    then (hybrid sharding, unless ``include_replicas`` is off) those of this
    rank's replicas (one or two tiny all-gathers)."""
    every = _gather_int(fingerprint, group.process_group, group.world_size, group.device)
    replicate = group.replicate_process_group
    if include_replicas and replicate is not None and group.replicate_size > 1:
        every += _gather_int(fingerprint, replicate, group.replicate_size, group.device)
    return every


def fingerprint_ranks(group: ShardGroup, include_replicas: bool = True) -> list[int]:
    """The global rank behind each position of :func:`all_gather_fingerprints`'s
    result (for messages)."""
    ranks = dist.get_process_group_ranks(group.process_group)
    replicate = group.replicate_process_group
    if include_replicas and replicate is not None and group.replicate_size > 1:
        ranks += dist.get_process_group_ranks(replicate)
    return ranks


def _gather_int(value: int, process_group: dist.ProcessGroup, size: int,
                device: torch.device) -> list[int]:
    if size == 1:
        return [value]
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    every = torch.empty(size, dtype=torch.int64, device=device)
    _all_gather_flat(every, mine, group=process_group)
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
