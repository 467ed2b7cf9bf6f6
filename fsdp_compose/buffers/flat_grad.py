"""The gradient side of one flat buffer: accumulation, folding the reduced
chunk into the sharded gradient, and handing it to the original parameters
(the reduce-scatter itself is issued by ``runtime/collective_queue.py``).

A :class:`FlatGradient` belongs to one ``flat_buffer.FlatBuffer``
(its ``owner``) and owns every tensor that holds that buffer's gradients
between autograd and the optimizer:

* the *unreduced* gradient: what autograd accumulated in ``owner.unsharded.grad``,
  plus, when accumulating without sync in a lower compute precision, a
  ``reduce_dtype`` accumulator (so micro-batches are summed in the reduce
  dtype, not in bf16), cast to ``reduce_comm_dtype`` only for the collective;
* the reduction in flight (``reducing``: issued, not waited; set and
  cleared by the collective queue);
* the *reduced* sharded gradient: full precision, ``S`` elements. Until it
  is published it is held here; once published, the parameters' ``.grad``
  view it, and the library keeps it and its views for the next reduction
  to write into once nobody else holds them (``kept_gradient.py``, [Note:
  the kept sharded gradient]; its memory is given back by ``zero_grad``,
  else at the next forward). Where it is not kept (pinned memory, or a torch that cannot
  count uses), only the ``.grad`` views keep it alive (a weak reference
  here), so ``zero_grad(set_to_none=True)`` frees it.

[Note: used parameters]
The flat gradient holds zeros for a parameter nobody used, so it cannot say
which parameters took part in a backward. The backward of the buffer's views
(one node per buffer per forward, ``param_views.py``) sees which parameters
received a gradient and marks them *used*. One process gives ``.grad is None`` to a parameter
that took no part in any backward since the gradients were cleared, and
optimizers with weight decay or momentum skip it; so do we. Which
parameters were used is the union over ranks (one process sees the global
batch), so publication all-reduces the flags once per backward for the
whole model (``runtime/end_of_backward.py``). A parameter used somewhere
gets a ``.grad`` on every rank, an empty one where the rank holds none of
it (``(0,)`` under ``"flat"``, ``(0, *rest)`` under ``"rows"``), so every
rank's optimizer holds state for the same parameters and
``[p.grad for p in params if p.grad is not None]`` agrees across ranks.
Under ``"owned"`` a non-owner keeps ``.grad is None``: its optimizer skips
the parameter and holds no state for it, which is what lets a matrix
optimizer (Muon) run on whole matrices, each on one rank.

[Note: reading .grad at publication]
A reduction adds to what the parameters' ``.grad`` hold (accumulation
across steps without ``zero_grad``), so the first reduction after a
publication must know whether any owned parameter still has a ``.grad``.
Where the published sharded gradient is still alive (a ``.grad`` views it,
or the user holds it), the reduction reads them and adds at once, as the
gradient arrives: its new chunk is freed right away (the memory FSDP2
keeps in that case too). Where it died (``zero_grad(set_to_none=True)``
dropped every view, the common case), the only ``.grad`` left could be
tensors the user assigned; the reduction then keeps its chunk as it is,
and publication, which writes every ``.grad`` anyway, reads them first
and adds them in. Reading every parameter's ``.grad`` at each reduction
cost more than the rest of it on the host-cost proxy (objects last
touched by the optimizer, a step ago); at publication they are about to
be written.
"""

from __future__ import annotations

import operator
import weakref
from collections import deque
from itertools import repeat
from typing import NamedTuple, Optional, Protocol, Sequence

import torch
import torch.nn as nn

from .._torch_private import CAN_COUNT_USES
from ..comm.collectives import finish_scaling
from ..comm.groups import ShardGroup
from .kept_gradient import KeptGradient
from .layout import FlatLayout, ShardSlice
from .reduce_subset import ReduceSubset, plan_subset
from .records import ParamRecord


class GradientOwner(Protocol):
    """What a :class:`FlatGradient` reads of the flat buffer that owns it
    (``flat_buffer.FlatBuffer``; a protocol, so that the buffer module
    imports this one and not the other way round)."""

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


class PendingCollective(Protocol):
    """A collective in flight (``runtime/collective_queue.InFlight``), as a
    buffer sees it: something to wait (completing ``member``, default every
    member) or to discard."""

    def wait(self, member: Optional[object] = None) -> None: ...

    def discard(self) -> None: ...


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
    """Gradient state of one flat buffer (see the module docstring)."""

    __slots__ = ('owner', 'reducing', 'saw_forward', 'used', '_accumulated',
                 '_current_training', '_every_param_receives', '_keeps', '_kept',
                 '_kept_unread', '_owned', '_owned_params', '_params', '_published',
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
        self.reducing: Optional[PendingCollective] = None
        """The reduction of this gradient in flight: its reduce-scatter, or
        under hybrid sharding then its all-reduce over the replicas (set
        and cleared by the collective queue)."""
        self._unpublished: Optional[torch.Tensor] = None
        """The reduced sharded gradient, not yet given to the parameters."""
        self._kept_unread: bool = False
        """``_unpublished`` was started without reading the parameters'
        ``.grad``: publication adds what they hold then (see [Note: reading
        .grad at publication])."""
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
        self._subsets: dict[tuple[bool, ...], Optional[ReduceSubset]] = {}
        self._subset: Optional[ReduceSubset] = None
        """The packing of the reduction in flight (``None``: the whole shard)."""

    def mark_used(self, param_grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Called by the backward of the buffer's views with each
        parameter's gradient: one that is ``None`` was not used."""
        self.used = list(map(operator.or_, self.used, map(operator.is_not, param_grads,
                                                          repeat(None))))

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
        """Forget what an iteration that raised left here (``reset_iter_state``):
        wait out its reduce-scatter (the collective still reads and writes
        our tensors) and drop the result, the unreduced gradient, no-sync
        accumulation and the used flags. Published ``.grad`` stays.

        Post-condition: nothing pending, unreduced or unpublished."""
        if self.reducing is not None:
            self.reducing.discard()
        self.reducing = None
        self._unpublished = None
        self._kept_unread = False
        self._subset = None
        self.discard_unreduced()
        self.used = [False] * len(self.used)

    # --------------------------------------------------------------- reduce
    @property
    def is_reducing(self) -> bool:
        return self.reducing is not None

    def settle(self) -> None:
        """Wait the reduction in flight, if any, to its end (under hybrid
        sharding the replica all-reduce it issues too): its chunk is folded
        into the unpublished sharded gradient."""
        while self.reducing is not None:
            flight = self.reducing
            flight.wait()
            if self.reducing is flight:  # completion always moves on; never spin
                self.reducing = None

    def take_for_reduce(self) -> Optional[torch.Tensor]:
        """The unreduced flat gradient in the dtype the reduce-scatter moves
        (``None``: no gradient reached the buffer); nothing unreduced is
        left here.

        Pre-condition: no reduction in flight (:meth:`settle`)."""
        owner = self.owner
        single = owner.group.world_size == 1
        training = self._current_training
        if self._trained_before_change is not None:
            training = tuple(a or b for a, b in zip(self._trained_before_change, training))
        self._trained_before_change, self.saw_forward = None, False
        subset = self._subsets.get(training, _UNPLANNED)  # _subset_for, without its call
        self._subset = self._subset_for(training) if subset is _UNPLANNED else subset
        # reduce_comm_dtype: the collective moves the narrower dtype (one rank: no cast)
        flat = self._take_unreduced(owner.reduce_dtype if single else owner.reduce_comm_dtype)
        return flat if flat is None or self._subset is None else self._subset.pack(flat)

    def fold_unreduced(self, options: ReduceOptions) -> None:
        """One rank and no replica: the unreduced flat gradient is the
        reduced one; fold it in (:meth:`take_for_reduce` then :meth:`fold`,
        without packing the parameters that train, which only saves bytes
        on a wire there is none of).

        Pre-condition: no reduction in flight."""
        self._trained_before_change, self.saw_forward = None, False
        flat = self._take_unreduced(self.owner.reduce_dtype)
        if flat is not None:
            self.fold(flat, options)

    @property
    def reduce_chunk(self) -> int:
        """Elements per rank of the reduce-scatter that :meth:`take_for_reduce`
        prepared: the shard, or the packed chunk of the parameters that train
        (see [Note: reducing a subset of a buffer])."""
        return self.owner.layout.shard_numel if self._subset is None else self._subset.chunk

    def note_training(self, flags: Sequence[bool]) -> None:
        """The parameters' ``requires_grad`` changed to ``flags`` (at a
        forward, before it runs): the next reduction moves the parameters
        that trained at any forward since the last one."""
        if self.saw_forward:
            before = self._trained_before_change or self._current_training
            self._trained_before_change = tuple(
                a or b for a, b in zip(before, self._current_training))
        self._current_training = tuple(flags)

    def _subset_for(self, training: tuple[bool, ...]) -> Optional[ReduceSubset]:
        subset = self._subsets.get(training, _UNPLANNED)
        if subset is _UNPLANNED:
            owner = self.owner
            subset = self._subsets[training] = plan_subset(owner.layout, training, owner.group.rank)
        return subset

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
        """A sharded gradient holding ``output``: the kept one (free here,
        see :meth:`fold`; taking ``output``'s memory where it can, else a
        copy), else ``output`` itself where it is in the parameters' dtype
        and device (and, where gradients are kept, its memory exactly),
        else a copy."""
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
        """The kept gradient, for the reduce-scatter of :meth:`take_for_reduce`
        to write into (``None``: allocate one): where it is free and is what
        :meth:`fold` would write the whole chunk into, in the collective's
        ``dtype`` on its ``device`` (see [Note: the kept sharded gradient])."""
        kept = self._kept
        owner = self.owner
        if kept is None or self._unpublished is not None or self._subset is not None or \
                dtype != owner.dtype or device != owner.storage_device or not kept.is_free:
            return None
        return kept.reclaim()

    def release_if_free(self) -> None:
        """Give back the kept gradient's memory where nobody holds it
        (``zero_grad(set_to_none=True)`` ran): called by ``zero_grad``
        (``gradients/torch_zero_grad.py``, ``ShardedModule.zero_grad``) and at the
        root's pre-forward, so that between steps, and in the step's forward
        and backward, no more is held than when each reduction made a new
        gradient."""
        kept = self._kept
        if kept is None or kept.released or self._unpublished is not None or \
                self.reducing is not None:
            return
        if kept.holders() == kept.baseline:  # is_free, without the property's call
            kept.release()

    def _kept_gradient(self) -> Optional[torch.Tensor]:
        """What the parameters' ``.grad`` hold now as one sharded gradient (a
        new reduction adds to it): the published one as the user left it,
        or a new one holding their tensors; ``None`` where every owned
        parameter's ``.grad`` was cleared (start anew)."""
        owner = self.owner
        owned = self._owned
        if all(map(operator.is_, map(_grad_of, self._owned_params), repeat(None))):
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
        return self._unpublished is not None or self.reducing is not None

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
        """Point each parameter's ``.grad`` at its slice of the reduced
        gradient: those ``used`` on some rank, and those that had a gradient
        already (accumulation); the others keep ``None``. Returns the
        parameters used in this reduction (their post-accumulate-grad hooks
        are due).

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
        if kept is not None and grad is kept.base:
            views = kept.views
        elif self._keeps and not owner.pin_memory and _owns_its_memory(grad):
            kept = self._kept = KeptGradient(grad, owner.local_views)
            views = kept.views
        else:
            self._kept = None
            views = owner.local_views(grad)
        if self._every_param_receives and all(used):  # the common case, one C-level loop
            deque(map(setattr, self._params, repeat("grad"), views), maxlen=0)
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


_grad_of = operator.attrgetter("grad")
_UNPLANNED = object()  # a ``_subsets`` key not planned yet (``None`` is a plan: the whole shard)


def _owns_its_memory(tensor: torch.Tensor) -> bool:
    """``tensor`` is all of its storage (kept gradients give back exactly
    their own memory)."""
    return tensor.storage_offset() == 0 and \
        tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def _in_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)`` without the call where it is a no-op (the
    common case, once per unit and step: ``to``'s argument parsing costs
    about a microsecond)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)
