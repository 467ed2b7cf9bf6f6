"""The gradient side of one flat buffer: accumulation, folding the reduced
chunk into the sharded gradient, and publishing it to the original
parameters. A :class:`FlatGradient` belongs to one ``FlatBuffer`` (its
``owner``) and owns every tensor holding its gradients between autograd and
the optimizer. ``S`` = ``owner.layout.shard_numel``.

[Note: the states of a flat gradient]
The first three states are one reduction's, in order; the last three the
published gradient's, which lives beside the next backward's unreduced one
(a gradient is in at most one state of each group).
:meth:`FlatGradient.assert_consistent` checks the table.

============= ==================================== ====================================
state         what is true                         moved by
============= ==================================== ====================================
*unreduced*   ``owner.unsharded.grad``             autograd (enters);
              (``padded_numel`` elements, where    ``stash_unreduced`` moves it into
              autograd accumulates) and/or         ``_accumulated``;
              ``_accumulated`` (``reduce_dtype``,  ``take_for_reduce`` takes it (->
              only where it differs from           reducing); ``fold_unreduced`` (one
              ``compute_dtype``: micro-batches     rank) -> unpublished;
              summed there, not in bf16);          ``discard_unreduced`` /
              ``has_unreduced``                    ``discard_iteration`` drop it
*reducing*    ``is_reducing``: handed to the       ``take_for_reduce`` (enters);
              queue, which keeps the collective    ``take_back`` -> unpublished
              in flight (the reduce-scatter, then  (``fold``) or into ``_partial``
              the replicas' all-reduce);           (``hold_partial``); the queue's
              ``_subset`` is its packing           ``settle`` waits it
*unpublished* ``_unpublished``: ``S`` elements in  ``fold`` (enters, adds to it);
              the parameters' dtype on             ``publish`` -> published or kept;
              ``storage_device``;                  ``discard_iteration`` and ``attach``
              ``_kept_unread``: the ``.grad`` are  drop it
              still to be added ([Note: reading
              .grad at publication])
*published*   ``_published`` (weak) is the         ``publish`` where it is not kept
              gradient the ``.grad`` views point   (pinned memory, or no
              into; ``_kept is None``: only those  ``CAN_COUNT_USES``); ``attach``
              views keep it alive
*kept*        ``_kept.base`` is ``_published()``,  ``publish``; ``reduce_output`` /
              its ``.grad`` views made once        ``fold`` write into it while free;
              ([Note: the kept sharded gradient]); ``fold`` leaves it to a user who
              its storage holds ``_kept.nbytes``   holds it (``_kept = None``)
*released*    kept and ``_kept.released``: its     ``release_if_free`` (``zero_grad``,
              storage holds 0 bytes and nothing    the root's pre-forward); ``reclaim``
              holds it                             / ``take_memory_of`` -> kept
============= ==================================== ====================================

[Note: used parameters]
A flat gradient holds zeros for unused parameters, so the views' backward
(``param_views.py``) marks the parameters that received a gradient *used*.
As in one process, a parameter unused since the gradients were cleared
keeps ``.grad is None`` (optimizers with weight decay or momentum skip it).
Used is the union over ranks (one process sees the global batch):
publication all-reduces the flags once per backward for the whole model
(``runtime/end_of_backward.py``). A parameter used anywhere gets a ``.grad``
on every rank, empty where the rank holds none of it (``(0,)`` under
``"flat"``, ``(0, *rest)`` under ``"rows"``), so every rank's optimizer
holds state for the same parameters. Under ``"owned"`` a non-owner keeps
``.grad is None``, so a matrix optimizer (Muon) runs on whole matrices,
each on one rank.

[Note: reading .grad at publication]
A reduction adds to what the parameters' ``.grad`` hold (accumulation
without ``zero_grad``). Where the published sharded gradient is alive (a
``.grad`` views it, or the user holds it), the reduction adds into it and
frees its chunk at once. Where it died (``zero_grad(set_to_none=True)``),
the only ``.grad`` left are tensors the user assigned: the reduction keeps
its chunk and publication, which writes every ``.grad`` anyway, adds them
in. Reading every ``.grad`` at each reduction would cost more host time
than the rest of the reduction.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional, Protocol, Sequence

import torch
import torch.nn as nn

from .._torch_private import CAN_COUNT_USES
from ..comm.collectives import finish_scaling
from ..comm.groups import ShardGroup
from .kept_gradient import KeptGradient
from .layout import FlatLayout, ShardSlice
from .reduce_subset import ReduceSubset, SubsetPlans
from .records import ParamRecord


class GradientOwner(Protocol):
    """What a :class:`FlatGradient` reads of its ``flat_buffer.FlatBuffer``
    (a protocol: the buffer module imports this one, not the other way)."""

    records: list[ParamRecord]
    group: ShardGroup
    layout: FlatLayout
    unsharded: torch.Tensor
    dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    reduce_comm_dtype: torch.dtype
    compute_device: torch.device
    storage_device: torch.device
    pin_memory: bool

    def local_slices(self) -> tuple[ShardSlice, ...]: ...

    def local_view(self, flat: torch.Tensor, index: int) -> torch.Tensor: ...

    def local_views(self, flat: torch.Tensor) -> list[torch.Tensor]: ...

    @property
    def grad_receivers(self) -> tuple[bool, ...]: ...

    def grad_where_empty(self, index: int) -> bool: ...


class ReduceOptions(NamedTuple):
    """How a unit's gradients are reduced across ranks.

    Attributes:
        divide_factor: the sum over ranks is divided by this (``None``: the
            number of ranks, i.e. the mean).
        force_sum: use only ``SUM`` collectives (divide locally afterwards).
    """

    divide_factor: Optional[float] = None
    force_sum: bool = False


class FlatGradient:
    """Gradient state of one flat buffer ([Note: the states of a flat gradient])."""

    __slots__ = ('owner', 'is_reducing', 'saw_forward', 'used', '_accumulated',
                 '_current_training', '_every_param_receives', '_keeps', '_kept',
                 '_kept_unread', '_owned', '_owned_params', '_params', '_partial', '_published',
                 '_subset', '_subsets', '_trained_before_change', '_unpublished',
                 '__dict__', '__weakref__')

    def __init__(self, owner: GradientOwner) -> None:
        self.owner: GradientOwner = owner
        count = len(owner.records)
        self.used: list[bool] = [False] * count
        """Per parameter: a gradient reached its view on this rank since the
        last publication (see [Note: used parameters])."""
        self._accumulated: Optional[torch.Tensor] = None
        """Unreduced flat gradient summed in ``reduce_dtype`` over backwards
        without sync (only when it differs from the compute dtype)."""
        self.is_reducing: bool = False
        """A reduction of this gradient is in flight, from
        :meth:`take_for_reduce` to :meth:`take_back` (its reduce-scatter,
        then under hybrid sharding its all-reduce over the replicas; the
        collective queue keeps it and waits it)."""
        self._unpublished: Optional[torch.Tensor] = None
        """The reduced sharded gradient, not yet given to the parameters."""
        self._partial: Optional[torch.Tensor] = None
        """Hybrid sharding with ``set_requires_all_reduce(False)``: the sum of
        the reduce-scatter outputs not all-reduced over the replicas yet."""
        self._kept_unread: bool = False
        """Publication adds the parameters' ``.grad`` to ``_unpublished``
        ([Note: reading .grad at publication])."""
        self._published: Optional[weakref.ref] = None
        """The sharded gradient the parameters' ``.grad`` views point into."""
        self._keeps: bool = CAN_COUNT_USES
        """Whether published gradients in pageable or device memory are kept
        (see [Note: the kept sharded gradient])."""
        self._kept: Optional[KeptGradient] = None
        """The last published gradient and its views, kept (``_keeps``)."""
        self._owned: tuple[tuple[nn.Parameter, int], ...] = tuple(
            (r.param, i) for i, (r, s) in enumerate(zip(owner.records, owner.local_slices()))
            if s.length)
        """The parameters (and their indices) with a piece on this rank."""
        self._owned_params: tuple[nn.Parameter, ...] = tuple(p for p, _ in self._owned)
        self._params: tuple[nn.Parameter, ...] = tuple(r.param for r in owner.records)
        self._every_param_receives: bool = all(owner.grad_receivers)
        self._current_training: tuple[bool, ...] = tuple(r.param.requires_grad for r in owner.records)
        """The parameters' ``requires_grad`` as of the last forward."""
        self._trained_before_change: Optional[tuple[bool, ...]] = None
        """Which parameters trained at a forward since the last reduction
        under earlier flags (``None``: every such forward had the current ones)."""
        self.saw_forward: bool = False
        """A forward that records a graph ran since the last reduction (set by
        the buffer at every such forward)."""
        self._subsets: SubsetPlans = SubsetPlans(owner.layout, owner.group.rank)
        self._subset: Optional[ReduceSubset] = None
        """The packing of the reduction in flight (``None``: the whole shard)."""

    def mark_used(self, param_grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Called by the backward of the buffer's views with each
        parameter's gradient: one that is ``None`` was not used."""
        self.used = [was_used or grad is not None
                     for was_used, grad in zip(self.used, param_grads)]

    # ------------------------------------------------------------ unreduced
    @property
    def has_unreduced(self) -> bool:
        return self.owner.unsharded.grad is not None or self._accumulated is not None

    def stash_unreduced(self) -> None:
        """Backward without sync finished: keep its gradient for the next
        reduction, summed in ``reduce_dtype`` if that is wider than the
        compute dtype (autograd would otherwise sum micro-batches in bf16)."""
        owner = self.owner
        grad = owner.unsharded.grad
        if grad is None or owner.reduce_dtype == owner.compute_dtype:
            return  # autograd keeps accumulating in unsharded.grad at full precision
        owner.unsharded.grad = None
        if self._accumulated is None:
            self._accumulated = grad.to(owner.reduce_dtype)
        else:
            self._accumulated.add_(grad)

    def _take_unreduced(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The unreduced flat gradient in ``dtype`` (micro-batches summed in
        ``reduce_dtype`` first); nothing unreduced is left here."""
        owner = self.owner
        grad, accumulated = owner.unsharded.grad, self._accumulated
        owner.unsharded.grad = None
        self._accumulated = None
        if accumulated is None:
            return grad if grad is None or grad.dtype == dtype else grad.to(dtype)
        if grad is not None:
            accumulated.add_(grad)
        return _in_dtype(accumulated, dtype)

    def discard_unreduced(self) -> None:
        self.owner.unsharded.grad = None
        self._accumulated = None

    def discard_iteration(self) -> None:
        """Forget what an iteration that raised left here: wait out its
        reduction (it still reads and writes our tensors), drop it, the
        unreduced gradient and the used flags. Published ``.grad`` stays.

        Post-condition: nothing pending, unreduced or unpublished."""
        self.is_reducing = False  # the queue discarded the collective first
        self._unpublished = None
        self._partial = None
        self._kept_unread = False
        self._subset = None
        self.discard_unreduced()
        self.used = [False] * len(self.used)

    # --------------------------------------------------------------- reduce
    def take_for_reduce(self) -> Optional[torch.Tensor]:
        """Unreduced -> taken: the flat gradient in the dtype the
        reduce-scatter moves (``None``: no gradient reached the buffer).

        Pre-condition: no reduction in flight (``CollectiveQueue.settle``).
        Post-condition: ``is_reducing`` when a gradient was handed over,
        until :meth:`take_back` returns its result."""
        owner = self.owner
        single = owner.group.world_size == 1
        training = self._current_training
        if self._trained_before_change is not None:
            training = tuple(a or b for a, b in zip(self._trained_before_change, training))
        self._trained_before_change, self.saw_forward = None, False
        self._subset = self._subsets[training]
        # reduce_comm_dtype: the collective moves the narrower dtype (one rank: no cast)
        flat = self._take_unreduced(owner.reduce_dtype if single else owner.reduce_comm_dtype)
        if flat is None:
            return None
        self.is_reducing = True
        return flat if self._subset is None else self._subset.pack(flat)

    def take_back(self, output: torch.Tensor, options: ReduceOptions,
                  partial: bool = False) -> None:
        """The reduction handed over by :meth:`take_for_reduce` is done:
        reducing -> unpublished (:meth:`fold` ``output``), or with
        ``partial`` (``set_requires_all_reduce(False)``) its sum is kept
        for the next one (:meth:`hold_partial`)."""
        self.is_reducing = False
        if partial:
            self.hold_partial(output)
        else:
            self.fold(output, options)

    def fold_unreduced(self, options: ReduceOptions) -> None:
        """One rank and no replica: unreduced -> unpublished, without packing
        (:meth:`take_for_reduce` then :meth:`fold`).

        Pre-condition: no reduction in flight."""
        self._trained_before_change, self.saw_forward = None, False
        flat = self._take_unreduced(self.owner.reduce_dtype)
        if flat is not None:
            self.fold(flat, options)

    @property
    def reduce_chunk(self) -> int:
        """Elements per rank of the prepared reduce-scatter ([Note: reducing
        a subset of a buffer])."""
        return self.owner.layout.shard_numel if self._subset is None else self._subset.chunk

    def note_training(self, flags: Sequence[bool]) -> None:
        """The parameters' ``requires_grad`` changed to ``flags`` at a
        forward: the next reduction moves those that trained at any forward
        since the last one."""
        if self.saw_forward:
            before = self._trained_before_change or self._current_training
            self._trained_before_change = tuple(
                a or b for a, b in zip(before, self._current_training))
        self._current_training = tuple(flags)

    def hold_partial(self, output: torch.Tensor) -> None:
        """Keep a reduce-scatter's ``output`` for a later all-reduce over the
        replicas (``set_requires_all_reduce(False)``), added to what earlier
        ones kept; nothing is folded."""
        if self._subset is not None:
            output, self._subset = self._subset.spread(output), None
        if self._partial is None:
            self._partial = output.clone()  # output may be the kept gradient, reused later
        else:
            self._partial.add_(output)

    def merge_partial(self, output: torch.Tensor) -> torch.Tensor:
        """``output`` (a reduce-scatter's, about to be all-reduced over the
        replicas) plus what :meth:`hold_partial` kept, which is cleared."""
        partial, self._partial = self._partial, None
        if partial is None:
            return output
        if self._subset is not None:
            output, self._subset = self._subset.spread(output), None
        return output.add_(partial)

    def take_partial(self) -> Optional[torch.Tensor]:
        """Partly reduced -> reducing: what :meth:`hold_partial` kept, handed
        over for its replica all-reduce at finalization (``None``: nothing
        kept); :meth:`take_back` returns the result."""
        partial, self._partial = self._partial, None
        if partial is not None:
            self.is_reducing = True
        return partial

    def pending_unreduced(self) -> Optional[torch.Tensor]:
        """The unreduced flat gradient as the next reduction reads it
        (``padded_numel`` elements), without moving it; ``None``: none."""
        grad = self.owner.unsharded.grad
        if self._accumulated is None:
            return grad
        if grad is not None:  # inside a backward without sync: not summed yet
            self.stash_unreduced()
        return self._accumulated

    def pending_partial(self) -> Optional[torch.Tensor]:
        """What :meth:`hold_partial` kept (``S`` elements), not moved."""
        return self._partial

    def drop_pending(self) -> None:
        """Forget the unreduced and the partly reduced gradient (``zero_grad``).

        Pre-condition: no reduction in flight."""
        self.discard_unreduced()
        self._partial = None

    def fold(self, output: torch.Tensor, options: ReduceOptions) -> None:
        """The reduced chunk (every rank of the mesh summed or averaged)
        scaled and added into the unpublished sharded gradient."""
        owner = self.owner
        if output.dtype != owner.reduce_dtype:  # reduce_comm_dtype: widen before dividing
            output = output.to(owner.reduce_dtype)
        if self._subset is not None:
            output, self._subset = self._subset.spread(output), None
        finish_scaling(output, owner.group, *options)
        base = self._unpublished
        if base is None:  # the first reduction since the last publication
            kept = self._kept
            if kept is not None and output is kept.base:  # reduced into it: free (reduce_output)
                self._kept_unread = True
                self._unpublished = output
                return
            if self.sharded_grad is not None:
                base = self._kept_gradient()  # the parameters' .grad may view it: add to it now
                if base is None:
                    self._kept = None  # every .grad cleared, but the user holds it: theirs now
            else:
                self._kept_unread = True  # see [Note: reading .grad at publication]
        if base is not None:
            base.add_(output.to(owner.storage_device, owner.dtype))
            self._unpublished = base
        else:
            self._unpublished = self._adopt(output)

    def _adopt(self, output: torch.Tensor) -> torch.Tensor:
        """A sharded gradient holding ``output``: the kept one (free here),
        else ``output`` itself where dtype, device (and memory, where kept)
        fit, else a copy."""
        owner = self.owner
        kept = self._kept
        matches = output.dtype == owner.dtype and output.device == owner.storage_device
        if kept is not None:
            if matches and kept.take_memory_of(output):  # over one rank: no copy
                return kept.base
            base = kept.reclaim()
            base.copy_(output)
            return base
        if matches and (not self._keeps or _owns_its_memory(output)):
            return output
        grad = torch.empty(owner.layout.shard_numel, dtype=owner.dtype,
                           device=owner.storage_device, pin_memory=owner.pin_memory)
        grad.copy_(output)  # blocking: the host reads it next
        return grad

    def reduce_output(self, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
        """The kept gradient for the reduce-scatter to write into, where it is
        free and what :meth:`fold` would write the whole chunk into
        (``None``: allocate one)."""
        kept = self._kept
        owner = self.owner
        if kept is None or self._unpublished is not None or self._subset is not None or \
                dtype != owner.dtype or device != owner.storage_device or not kept.is_free:
            return None
        return kept.reclaim()

    def release_if_free(self) -> None:
        """Kept -> released where nobody holds it (called by ``zero_grad``
        and the root's pre-forward)."""
        kept = self._kept
        if kept is None or kept.released or self._unpublished is not None or \
                self.is_reducing:
            return
        if kept.holders() == kept.baseline:  # is_free, without the property's call
            kept.release()

    def _kept_gradient(self) -> Optional[torch.Tensor]:
        """What the parameters' ``.grad`` hold now as one sharded gradient
        for a reduction to add to (``None``: every owned ``.grad`` cleared)."""
        owner = self.owner
        owned = self._owned
        if all(param.grad is None for param in self._owned_params):
            return None
        base = self.sharded_grad
        if base is None:  # the user's .grad tensors are not ours (e.g. after module.to())
            base = torch.zeros(owner.layout.shard_numel, dtype=owner.dtype,
                               device=owner.storage_device, pin_memory=owner.pin_memory)
        for param, index in owned:
            region = owner.local_view(base, index)
            if param.grad is None:
                region.zero_()
            elif param.grad.data_ptr() != region.data_ptr():
                region.copy_(param.grad)
        return base

    # -------------------------------------------------------------- publish
    @property
    def has_unpublished(self) -> bool:
        return self._unpublished is not None or self.is_reducing

    @property
    def sharded_grad(self) -> Optional[torch.Tensor]:
        """The published sharded gradient, while any ``.grad`` views it (or,
        where it is kept, while anything but the library holds it)."""
        kept = self._kept
        if kept is not None:
            return None if kept.is_free else kept.base
        return None if self._published is None else self._published()

    def kept_views(self) -> Optional[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        """The kept sharded gradient and each parameter's ``.grad`` view of
        it, by parameter index (``None``: none kept). A parameter whose
        ``.grad`` *is* its view here has its gradient at its own place in
        the base (the flat optimizer step reads the base directly)."""
        kept = self._kept
        return None if kept is None or kept.released else (kept.base, kept.views)

    def publish(self, used: Sequence[bool]) -> list[nn.Parameter]:
        """Unpublished -> published or kept: each parameter ``used`` on some
        rank, or with a ``.grad`` already, gets its slice as ``.grad``; the
        others keep ``None``. Returns the used ones (their
        post-accumulate-grad hooks are due).

        Pre-condition: no reduction in flight (:meth:`settle`).
        """
        grad, self._unpublished = self._unpublished, None
        self.used = [False] * len(self.used)
        if grad is None:
            return []
        if self._kept_unread:  # see [Note: reading .grad at publication]
            self._kept_unread = False
            held = self._kept_gradient()
            if held is not None:
                grad = held.add_(grad)
        self._published = weakref.ref(grad)
        owner = self.owner
        kept = self._kept
        views: Sequence[torch.Tensor]
        if kept is not None and grad is kept.base:
            views = kept.views
        elif self._keeps and not owner.pin_memory and _owns_its_memory(grad):
            kept = self._kept = KeptGradient(grad, owner.local_views)
            views = kept.views
        else:
            self._kept = None
            views = owner.local_views(grad)
        if self._every_param_receives and all(used):  # the common case
            for param, view in zip(self._params, views):
                param.grad = view
            return list(self._params)
        fresh = []
        for record, view, receives, was_used in zip(owner.records, views, owner.grad_receivers,
                                                    used):
            if not receives:
                continue  # holds none of it: .grad stays None here (see the note)
            param = record.param
            if was_used:
                param.grad = view
                fresh.append(param)
            elif param.grad is not None:
                param.grad = view
        return fresh

    def assert_consistent(self) -> None:
        """Assert what [Note: the states of a flat gradient] says is true of
        the states the gradient is in now (a broken transition fails here;
        tests call it between steps)."""
        owner = self.owner
        rank = f"rank {owner.group.rank} of {owner.group.world_size}, {owner!r}"
        shard = owner.layout.shard_numel
        unreduced = owner.unsharded.grad
        assert unreduced is None or unreduced.shape == owner.unsharded.shape, (
            f"{rank}: unreduced gradient of shape {tuple(unreduced.shape)}")
        accumulated = self._accumulated
        assert accumulated is None or (
            accumulated.dtype == owner.reduce_dtype != owner.compute_dtype
            and accumulated.numel() == owner.layout.padded_numel), (
            f"{rank}: no-sync accumulator {accumulated.dtype} of {accumulated.numel()} elements")
        unpublished = self._unpublished
        assert unpublished is None or (
            unpublished.numel() == shard and unpublished.dtype == owner.dtype
            and unpublished.device == owner.storage_device), (
            f"{rank}: unpublished gradient {unpublished.dtype} of {unpublished.numel()} "
            f"elements on {unpublished.device}")
        assert not self._kept_unread or unpublished is not None, (
            f"{rank}: .grad to add at publication but nothing unpublished")
        kept = self._kept
        if kept is not None:
            assert self._keeps and self._published is not None and \
                self._published() is kept.base, f"{rank}: kept gradient is not the published one"
            assert kept.base.numel() == shard and len(kept.views) == len(owner.records), (
                f"{rank}: kept gradient of {kept.base.numel()} elements, {len(kept.views)} views")
            nbytes = kept.storage.nbytes()
            assert nbytes == (0 if kept.released else kept.nbytes), (
                f"{rank}: kept gradient's storage holds {nbytes} bytes "
                f"({'released' if kept.released else 'not released'})")
        published = self.sharded_grad
        for param, index in self._owned:
            grad = param.grad
            assert grad is None or published is None or grad.shape == \
                owner.local_view(published, index).shape, (
                f"{rank}: '{owner.records[index].fqn}'.grad has shape {tuple(grad.shape)}")
        assert len(self.used) == len(owner.records), f"{rank}: {len(self.used)} used flags"

    def attach(self, grad: Optional[torch.Tensor], has_grad: Sequence[bool]) -> None:
        """Adopt ``grad`` (``S`` elements, the parameters' dtype and device)
        as the published sharded gradient of the parameters flagged in
        ``has_grad``, e.g. after a dtype conversion."""
        self._unpublished = None
        self._kept_unread = False
        self._kept = None
        self._published = None if grad is None else weakref.ref(grad)
        if grad is None:
            return
        for index, (record, flag) in enumerate(zip(self.owner.records, has_grad)):
            if flag:
                record.param.grad = self.owner.local_view(grad, index)


def _owns_its_memory(tensor: torch.Tensor) -> bool:
    """``tensor`` is all of its storage (kept gradients give back exactly
    their own memory)."""
    return tensor.storage_offset() == 0 and \
        tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def _in_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, skipping the call (and its argument parsing) where it is a no-op."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)
