"""One flat buffer: the storage, views and collectives of a group of original
parameters with the same dtype and the same ``requires_grad``.

[Note: storage and autograd]
The unsharded flat buffer is a leaf tensor of ``F * S`` elements that lives
for the whole life of the unit. Resharding does not drop the tensor; it
resizes its *storage* to zero bytes, and unsharding resizes it back and
all-gathers into it. Tensors that autograd saved during forward (views of the
buffer) therefore stay valid objects that hold no memory while the unit is
sharded, and read correct values again once the pre-backward hook unshards.
The all-gather writes through a detached alias and restores the same
values, so autograd must not see it as an in-place modification of the saved
views: the version counter is put back after the collective is issued and
again after it completes (gloo bumps it from its own thread when an
asynchronous work finishes).
The per-parameter views (split + view of the leaf) route the gradients of
all original parameters into one flat gradient, which is exactly the
reduce-scatter input. Their autograd nodes save no tensors, but they are
rebuilt at every forward that records a graph: the CPU autograd engine runs
ready nodes by sequence number, newest first, so views built once at
``fully_shard`` time would be the oldest nodes of every graph and would only
run (and fire the post-backward hook that reduces and reshards) after all of
backward, keeping every unit unsharded until the end.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn as nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from ._comm import ShardGroup, all_gather_into, reduce_scatter_mean
from ._layout import FlatLayout, ShardSlice
from ._staging import StagingPool


@dataclass
class ParamRecord:
    """One original parameter managed by a flat buffer.

    Attributes:
        param: the original ``nn.Parameter`` (identity kept for the user).
        slots: every ``(module, attribute name)`` that registers it within
            the unit (more than one when a parameter is shared inside a unit).
        fqn: its fully-qualified name relative to the outermost annotated
            module seen so far (updated when an ancestor is annotated).
        shape: its original shape.
    """

    param: nn.Parameter
    slots: list[tuple[nn.Module, str]]
    fqn: str
    shape: torch.Size


class BufferPolicy(NamedTuple):
    """Precision and placement of one flat buffer (derived from the unit's
    ``MixedPrecisionPolicy`` and ``CPUOffloadPolicy``).

    Attributes:
        compute_dtype: dtype of the unsharded buffer and the all-gather
            (``None``: the parameters' dtype).
        reduce_dtype: dtype of the reduce-scatter (``None``: ``compute_dtype``).
        offload_to_cpu: keep ``sharded``/``sharded_grad`` on the CPU.
        pin_memory: pin them (only meaningful with CUDA).
    """

    compute_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    offload_to_cpu: bool = False
    pin_memory: bool = False


class _PendingGather(NamedTuple):
    work: object  # torch.distributed.Work
    shard: torch.Tensor  # the collective's input: alive until the work is done
    version: int  # the unsharded buffer's version before the collective


class _PendingReduce(NamedTuple):
    work: object  # torch.distributed.Work
    flat_grad: torch.Tensor  # the collective's input: alive until the work is done
    output: torch.Tensor  # this rank's reduced chunk (the new sharded_grad when in_place)
    in_place: bool
    accumulate_into: Optional[torch.Tensor]  # the sharded_grad to add to (None: start anew)


class FlatBuffer:
    """Sharded storage plus unsharded working buffer for a list of parameters.

    Invariants (``F`` = world size, ``S`` = ``layout.shard_numel``):

    * ``sharded`` (``S`` elements, the parameters' dtype, on the compute device
      or the CPU when offloaded) is the only persistent storage of the values;
      between iterations every original parameter's ``.data`` is the 1-D slice
      of it this rank owns;
    * ``unsharded`` (``F * S`` elements, ``compute_dtype``, compute device) has
      storage only while ``is_unsharded``; it requires grad exactly when the
      group is trainable;
    * ``sharded_grad`` (``S`` elements, like ``sharded``) holds the
      mean-reduced gradient of this rank's shard. Only the parameters'
      ``.grad`` views keep it alive (the buffer holds a weak reference), so
      ``zero_grad(set_to_none=True)`` frees it between iterations.
    """

    def __init__(self, records: list[ParamRecord], group: ShardGroup,
                 post_accumulate_grad: Optional[Callable[["FlatBuffer"], None]] = None,
                 policy: BufferPolicy = BufferPolicy()) -> None:
        if not records:
            raise AssertionError("a flat buffer needs at least one parameter")
        # What it holds
        self.records: list[ParamRecord] = records
        self.group: ShardGroup = group
        self.layout: FlatLayout = FlatLayout([r.shape for r in records], group.world_size)
        self.requires_grad: bool = records[0].param.requires_grad
        self.dtype: torch.dtype = records[0].param.dtype
        self._slices: tuple[ShardSlice, ...] = self.layout.shard_slices(group.rank)

        # Precision and placement
        self.compute_dtype: torch.dtype = policy.compute_dtype or self.dtype
        self.reduce_dtype: torch.dtype = policy.reduce_dtype or self.compute_dtype
        self.compute_device: torch.device = group.device
        self.storage_device: torch.device = (
            torch.device("cpu") if policy.offload_to_cpu else group.device)
        self._pin: bool = (policy.pin_memory and self.storage_device.type == "cpu"
                           and self.compute_device.type != "cpu")

        # Storage
        self.sharded: torch.Tensor = self._shard_values(self.storage_device)
        self.unsharded: torch.Tensor = torch.empty(
            self.layout.padded_numel, dtype=self.compute_dtype, device=self.compute_device,
            requires_grad=self.requires_grad)
        self._sharded_grad: Optional[weakref.ref] = None
        self.is_unsharded: bool = False
        self._gather: Optional[_PendingGather] = None
        """The in-flight all-gather into ``unsharded`` (issued, not waited)."""
        self._reduce: Optional[_PendingReduce] = None
        """The in-flight reduce-scatter of the flat gradient (issued, not waited)."""
        self.staging: Optional[StagingPool] = None
        """Where the unsharded storage's memory comes from and goes back to
        (CPU only; ``None``: the allocator directly)."""
        self._versions_at_unshard: tuple[int, ...] = ()
        """The parameters' version counters when the unsharded copy was made:
        an optimizer step bumps them, which makes the copy stale."""

        # Views, built once
        self._sharded_views: list[torch.Tensor] = [
            self.sharded.narrow(0, s.shard_start, s.length) for s in self._slices]
        self._unsharded_views: list[torch.Tensor] = self._build_unsharded_views()
        self.unsharded.untyped_storage().resize_(0)  # views exist; now free the memory
        for record, view in zip(records, self._sharded_views):
            record.param.data = view

        if self.requires_grad and post_accumulate_grad is not None:
            self.unsharded.register_post_accumulate_grad_hook(
                lambda _tensor: post_accumulate_grad(self))

    # ------------------------------------------------------------------ setup
    def _shard_values(self, device: torch.device) -> torch.Tensor:
        """Copy this rank's slice of every parameter into a new shard; the
        full values are not kept (memory drops as soon as the caller lets go)."""
        shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=device,
                            pin_memory=self._pin)
        for record, s in zip(self.records, self._slices):
            if s.length:
                flat = record.param.detach().reshape(-1)
                shard[s.shard_start:s.shard_start + s.length].copy_(
                    flat[s.param_start:s.param_start + s.length])
        return shard

    def _build_unsharded_views(self) -> list[torch.Tensor]:
        sizes = list(self.layout.numels)
        if self.layout.padding:
            sizes.append(self.layout.padding)
        with torch.enable_grad():
            chunks = torch.split(self.unsharded, sizes)
            return [chunk.view(record.shape) for chunk, record in zip(chunks, self.records)]

    # -------------------------------------------------------------- unshard
    def unshard(self) -> None:
        """All-gather the full values and point the module attributes at them.

        Post-condition: ``is_unsharded``; every slot holds a view of
        ``unsharded`` with the original shape.
        """
        self.start_unshard()
        self.finish_unshard()

    def start_unshard(self) -> None:
        """Issue the all-gather without waiting for it (a prefetch).

        Post-condition: ``is_unsharded`` or ``is_gathering``.
        """
        if self._gather is not None:
            return  # already in flight: a prefetch got here first
        if self.is_unsharded:
            if not self.is_stale:
                return  # already unsharded: an earlier pre-forward or unshard() got here first
            # Kept unsharded (reshard_after_backward=False or a manual unshard())
            # across an optimizer step: gather the new values.
            self.reshard()
        nbytes = self.layout.padded_numel * self.unsharded.element_size()
        if self.staging is not None:
            self.staging.fill(self.unsharded.untyped_storage(), nbytes)
        else:
            self.unsharded.untyped_storage().resize_(nbytes)
        # One copy to the compute device and dtype (none without offload or
        # mixed precision), so the all-gather moves compute_dtype bytes.
        shard = self.sharded.to(self.compute_device, self.compute_dtype, non_blocking=True)
        version = self.unsharded._version
        with _unsafe_preserve_version_counter(self.unsharded):
            work = all_gather_into(self.unsharded.detach(), shard, self.group, async_op=True)
        self._gather = _PendingGather(work, shard, version)

    def finish_unshard(self) -> None:
        """Wait for the in-flight all-gather (if any) and switch to the
        unsharded views. On CUDA the wait only orders the current stream
        after the collective; the host does not block."""
        gather = self._gather
        if gather is None:
            return  # nothing in flight: already unsharded (or never started)
        self._gather = None
        gather.work.wait()
        # see [Note: storage and autograd]
        torch._C._autograd._unsafe_set_version_counter((self.unsharded,), (gather.version,))
        self.is_unsharded = True
        self._versions_at_unshard = tuple(r.param._version for r in self.records)
        self.use_unsharded_views()

    @property
    def is_gathering(self) -> bool:
        return self._gather is not None

    @property
    def is_stale(self) -> bool:
        """Whether the sharded values changed (e.g. an optimizer step) since
        the unsharded copy was gathered."""
        return self.is_unsharded and self._versions_at_unshard != tuple(
            r.param._version for r in self.records)

    def refresh_views(self) -> None:
        """Build new per-parameter views for a forward that records a graph
        (see the note above) and point the module attributes at them."""
        self._unsharded_views = self._build_unsharded_views()
        self.use_unsharded_views()

    def use_unsharded_views(self) -> None:
        for record, view in zip(self.records, self._unsharded_views):
            for module, name in record.slots:
                module._parameters[name] = view  # type: ignore[assignment]

    def reshard(self) -> None:
        """Restore the original parameters and free the unsharded storage.

        Post-condition: not ``is_unsharded``; ``unsharded`` holds no storage;
        every slot holds its original ``nn.Parameter``.
        """
        if self._gather is not None:
            self.finish_unshard()  # a prefetch nobody used: the storage is being written
        if not self.is_unsharded:
            return  # already sharded: nothing to free
        for record in self.records:
            for module, name in record.slots:
                module._parameters[name] = record.param
        if self.staging is not None:
            self.staging.drain(self.unsharded.untyped_storage())
        else:
            self.unsharded.untyped_storage().resize_(0)
        self.is_unsharded = False

    # --------------------------------------------------------------- reduce
    @property
    def has_unreduced_grad(self) -> bool:
        return self.unsharded.grad is not None

    def reduce_grad(self) -> None:
        """Reduce the flat gradient now (``start_reduce`` + ``finish_reduce``)."""
        self.start_reduce()
        self.finish_reduce()

    def start_reduce(self) -> bool:
        """Issue the reduce-scatter (mean over ranks, in ``reduce_dtype``) of
        the flat gradient that autograd accumulated in ``unsharded.grad``;
        returns whether one was issued.

        Post-condition: ``unsharded.grad is None``; the flat gradient is kept
        alive by the pending reduction until :meth:`finish_reduce`.
        """
        if self._reduce is not None:
            raise AssertionError(f"[rank {self.group.rank}] {self}: reduce-scatter already in flight")
        flat_grad = self.unsharded.grad
        if flat_grad is None:
            return False  # no gradient reached this buffer in this backward
        self.unsharded.grad = None
        flat_grad = flat_grad.to(self.reduce_dtype)
        existing = self.sharded_grad
        overwrite = existing is None or self._all_user_grads_cleared()
        if overwrite:
            existing = None  # the user dropped every .grad: start from zero
        in_place = (overwrite and self.reduce_dtype == self.dtype
                    and self.storage_device == self.compute_device)
        output = torch.empty(self.layout.shard_numel, dtype=self.reduce_dtype,
                             device=self.compute_device)
        work = reduce_scatter_mean(output, flat_grad, self.group, async_op=True)
        self._reduce = _PendingReduce(work, flat_grad, output, in_place, existing)
        return True

    def finish_reduce(self) -> None:
        """Wait for the in-flight reduce-scatter and fold its result into the
        sharded gradient.

        Post-condition: every parameter with elements on this rank has
        ``.grad`` viewing ``sharded_grad``.
        """
        pending = self._reduce
        if pending is None:
            return  # nothing in flight
        self._reduce = None
        pending.work.wait()
        if pending.in_place:
            grad = pending.output  # already the right dtype and device
        elif pending.accumulate_into is None:
            grad = torch.empty(self.layout.shard_numel, dtype=self.dtype,
                               device=self.storage_device, pin_memory=self._pin)
            grad.copy_(pending.output)  # blocking: read on the host next
        else:
            grad = pending.accumulate_into
            self._absorb_user_grads(grad)
            grad.add_(pending.output.to(self.storage_device, self.dtype))
        self._sharded_grad = weakref.ref(grad)
        self._attach_grads(grad)

    @property
    def sharded_grad(self) -> Optional[torch.Tensor]:
        """The sharded gradient, while any parameter's ``.grad`` views it."""
        return None if self._sharded_grad is None else self._sharded_grad()

    @property
    def is_reducing(self) -> bool:
        return self._reduce is not None

    def _all_user_grads_cleared(self) -> bool:
        return all(r.param.grad is None for r, s in zip(self.records, self._slices) if s.length)

    def _absorb_user_grads(self, grad: torch.Tensor) -> None:
        """Make ``grad`` agree with the parameters' ``.grad`` as the user left
        them (``None``: zero; a replaced tensor: its values)."""
        for record, s in zip(self.records, self._slices):
            if not s.length:
                continue
            region = grad.narrow(0, s.shard_start, s.length)
            user = record.param.grad
            if user is None:
                region.zero_()
            elif user.data_ptr() != region.data_ptr():
                region.copy_(user)

    def _attach_grads(self, grad: torch.Tensor) -> None:
        """Point each parameter's ``.grad`` at its slice of ``grad`` (``None``
        where this rank owns no element)."""
        for record, s in zip(self.records, self._slices):
            if s.length:
                record.param.grad = grad.narrow(0, s.shard_start, s.length)

    def discard_unreduced_grad(self) -> None:
        self.unsharded.grad = None

    # ----------------------------------------------------------- inspection
    def full_param_views(self) -> list[torch.Tensor]:
        """The unsharded per-parameter views (valid only while unsharded)."""
        return self._unsharded_views

    def local_slices(self) -> tuple[ShardSlice, ...]:
        return self._slices

    def __repr__(self) -> str:
        kind = "trainable" if self.requires_grad else "frozen"
        return f"FlatBuffer({kind}, {self.dtype}, {len(self.records)} params, {self.layout})"
