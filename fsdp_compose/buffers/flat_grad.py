"""The gradient side of one flat buffer (its ``owner``): accumulation, folding, publication.
``S`` = ``owner.layout.shard_numel``.

[Note: the states of a flat gradient]
Unreduced (``owner.unsharded.grad`` or ``_accumulated``) -> reducing -> unpublished (``S``
elements) -> *published* (the ``.grad`` views' base), *kept* or *released* (0 bytes).
:meth:`FlatGradient.assert_consistent` checks them.

[Note: used parameters]
As in one process, a parameter unused since the gradients were cleared keeps ``.grad is None``.
Used is the union over ranks, so every optimizer holds the same state (under ``"owned"`` a
non-owner keeps ``None``).

[Note: reading .grad at publication]
After ``set_to_none=True`` the only ``.grad`` left are the user's: publication adds them,
rather than each reduction reading them.

[Note: the kept sharded gradient]
The ``.grad`` views and the sharded gradient are kept across steps and written into while
nobody outside holds them (:meth:`KeptGradient.holders`); a free one is *released* after
``zero_grad`` or at the root's pre-forward. Only where ``CAN_COUNT_USES``, not pinned.
"""

from __future__ import annotations

import sys
import weakref
from typing import Callable, NamedTuple, Optional, Protocol, Sequence

import torch
import torch.nn as nn

from .._torch_private import (CAN_COUNT_USES, CAN_SWAP_STORAGE_DATA, storage_key,
                              storage_key_use_count, storage_use_count, swap_storage_data,
                              tensor_use_count)
from ..comm.wire import finish_scaling
from ..comm.groups import ShardGroup
from .layout import FlatLayout, ShardSlice
from .reduce_subset import ReduceSubset, SubsetPlans
from .records import ParamRecord


class GradientOwner(Protocol):
    """What a :class:`FlatGradient` reads of its buffer."""

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
    """How a unit's gradients are reduced.

    Attributes:
        divide_factor: divides the sum (``None``: the number of ranks).
        force_sum: ``SUM`` collectives only."""

    divide_factor: Optional[float] = None
    force_sum: bool = False


class FlatGradient:

    __slots__ = ('owner', 'is_reducing', 'saw_forward', 'used', '_accumulated',
                 '_current_training', '_every_param_receives', '_keeps', '_kept',
                 '_kept_unread', '_owned', '_owned_params', '_params', '_partial', '_published',
                 '_subset', '_subsets', '_trained_before_change', '_unpublished',
                 '__dict__', '__weakref__')

    def __init__(self, owner: GradientOwner) -> None:
        self.owner: GradientOwner = owner
        count = len(owner.records)
        self.used: list[bool] = [False] * count
        """Per parameter ([Note: used parameters])."""
        self._accumulated: Optional[torch.Tensor] = None
        self.is_reducing: bool = False
        self._unpublished: Optional[torch.Tensor] = None
        self._partial: Optional[torch.Tensor] = None
        """Outputs awaiting the replica all-reduce."""
        self._kept_unread: bool = False
        self._published: Optional[weakref.ref] = None
        self._keeps: bool = CAN_COUNT_USES
        self._kept: Optional[KeptGradient] = None
        self._owned: tuple[tuple[nn.Parameter, int], ...] = tuple(
            (r.param, i) for i, (r, s) in enumerate(zip(owner.records, owner.local_slices()))
            if s.length)
        self._owned_params: tuple[nn.Parameter, ...] = tuple(p for p, _ in self._owned)
        self._params: tuple[nn.Parameter, ...] = tuple(r.param for r in owner.records)
        self._every_param_receives: bool = all(owner.grad_receivers)
        self._current_training: tuple[bool, ...] = tuple(r.param.requires_grad for r in owner.records)
        self._trained_before_change: Optional[tuple[bool, ...]] = None
        """Earlier forwards' flags since the last reduction."""
        self.saw_forward: bool = False
        self._subsets: SubsetPlans = SubsetPlans(owner.layout, owner.group.rank)
        self._subset: Optional[ReduceSubset] = None

    def mark_used(self, param_grads: Sequence[Optional[torch.Tensor]]) -> None:
        """A ``None`` gradient means unused."""
        self.used = [was_used or grad is not None
                     for was_used, grad in zip(self.used, param_grads)]

    @property
    def has_unreduced(self) -> bool:
        return self.owner.unsharded.grad is not None or self._accumulated is not None

    def stash_unreduced(self) -> None:
        """Backward without sync."""
        owner = self.owner
        grad = owner.unsharded.grad
        if grad is None or owner.reduce_dtype == owner.compute_dtype:
            return
        owner.unsharded.grad = None
        if self._accumulated is None:
            self._accumulated = grad.to(owner.reduce_dtype)
        else:
            self._accumulated.add_(grad)

    def _take_unreduced(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
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
        """An iteration raised. Post-condition: nothing pending; ``.grad`` stays."""
        self.is_reducing = False
        self._unpublished = None
        self._partial = None
        self._kept_unread = False
        self._subset = None
        self.discard_unreduced()
        self.used = [False] * len(self.used)

    def take_for_reduce(self) -> Optional[torch.Tensor]:
        """Unreduced -> reducing (``None``: no gradient). Pre-condition: none in flight."""
        owner = self.owner
        single = owner.group.world_size == 1
        training = self._current_training
        if self._trained_before_change is not None:
            training = tuple(a or b for a, b in zip(self._trained_before_change, training))
        self._trained_before_change, self.saw_forward = None, False
        self._subset = self._subsets[training]
        flat = self._take_unreduced(owner.reduce_dtype if single else owner.reduce_comm_dtype)
        if flat is None:
            return None
        self.is_reducing = True
        return flat if self._subset is None else self._subset.pack(flat)

    def take_back(self, output: torch.Tensor, options: ReduceOptions,
                  partial: bool = False) -> None:
        """Reducing -> unpublished, or with ``partial`` held for a replica all-reduce."""
        self.is_reducing = False
        if partial:
            self.hold_partial(output)
        else:
            self.fold(output, options)

    def fold_unreduced(self, options: ReduceOptions) -> None:
        """One rank: unreduced -> unpublished. Pre-condition: none in flight."""
        self._trained_before_change, self.saw_forward = None, False
        flat = self._take_unreduced(self.owner.reduce_dtype)
        if flat is not None:
            self.fold(flat, options)

    @property
    def reduce_chunk(self) -> int:
        return self.owner.layout.shard_numel if self._subset is None else self._subset.chunk

    def note_training(self, flags: Sequence[bool]) -> None:
        """``requires_grad`` changed at a forward."""
        if self.saw_forward:
            before = self._trained_before_change or self._current_training
            self._trained_before_change = tuple(
                a or b for a, b in zip(before, self._current_training))
        self._current_training = tuple(flags)

    def hold_partial(self, output: torch.Tensor) -> None:
        """Add to what awaits a replica all-reduce."""
        if self._subset is not None:
            output, self._subset = self._subset.spread(output), None
        if self._partial is None:
            self._partial = output.clone()  # may be the kept gradient
        else:
            self._partial.add_(output)

    def merge_partial(self, output: torch.Tensor) -> torch.Tensor:
        partial, self._partial = self._partial, None
        if partial is None:
            return output
        if self._subset is not None:
            output, self._subset = self._subset.spread(output), None
        return output.add_(partial)

    def take_partial(self) -> Optional[torch.Tensor]:
        """Partly reduced -> reducing (``None``: nothing held)."""
        partial, self._partial = self._partial, None
        if partial is not None:
            self.is_reducing = True
        return partial

    def pending_unreduced(self) -> Optional[torch.Tensor]:
        """The unreduced gradient, not moved."""
        grad = self.owner.unsharded.grad
        if self._accumulated is None:
            return grad
        if grad is not None:
            self.stash_unreduced()
        return self._accumulated

    def pending_partial(self) -> Optional[torch.Tensor]:
        return self._partial

    def drop_pending(self) -> None:
        """Pre-condition: none in flight."""
        self.discard_unreduced()
        self._partial = None

    def fold(self, output: torch.Tensor, options: ReduceOptions) -> None:
        """Add the reduced chunk, scaled."""
        owner = self.owner
        if output.dtype != owner.reduce_dtype:
            output = output.to(owner.reduce_dtype)
        if self._subset is not None:
            output, self._subset = self._subset.spread(output), None
        finish_scaling(output, owner.group, *options)
        base = self._unpublished
        if base is None:
            kept = self._kept
            if kept is not None and output is kept.base:  # reduce_output gave it: free
                self._kept_unread = True
                self._unpublished = output
                return
            if self.sharded_grad is not None:
                base = self._kept_gradient()
                if base is None:
                    self._kept = None  # the user holds it
            else:
                self._kept_unread = True  # see [Note: reading .grad at publication]
        if base is not None:
            base.add_(output.to(owner.storage_device, owner.dtype))
            self._unpublished = base
        else:
            self._unpublished = self._adopt(output)

    def _adopt(self, output: torch.Tensor) -> torch.Tensor:
        owner = self.owner
        kept = self._kept
        matches = output.dtype == owner.dtype and output.device == owner.storage_device
        if kept is not None:
            if matches and kept.take_memory_of(output):
                return kept.base
            base = kept.reclaim()
            base.copy_(output)
            return base
        if matches and (not self._keeps or _owns_its_memory(output)):
            return output
        grad = torch.empty(owner.layout.shard_numel, dtype=owner.dtype,
                           device=owner.storage_device, pin_memory=owner.pin_memory)
        grad.copy_(output)
        return grad

    def reduce_output(self, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
        """The kept gradient where free (``None``: allocate)."""
        kept = self._kept
        owner = self.owner
        if kept is None or self._unpublished is not None or self._subset is not None or \
                dtype != owner.dtype or device != owner.storage_device or not kept.is_free:
            return None
        return kept.reclaim()

    def release_if_free(self) -> None:
        """Kept -> released where nobody holds it."""
        kept = self._kept
        if kept is None or kept.released or self._unpublished is not None or \
                self.is_reducing:
            return
        if kept.holders() == kept.baseline:
            kept.release()

    def _kept_gradient(self) -> Optional[torch.Tensor]:
        """``None``: every ``.grad`` cleared."""
        owner = self.owner
        owned = self._owned
        if all(param.grad is None for param in self._owned_params):
            return None
        base = self.sharded_grad
        if base is None:
            base = torch.zeros(owner.layout.shard_numel, dtype=owner.dtype,
                               device=owner.storage_device, pin_memory=owner.pin_memory)
        for param, index in owned:
            region = owner.local_view(base, index)
            if param.grad is None:
                region.zero_()
            elif param.grad.data_ptr() != region.data_ptr():
                region.copy_(param.grad)
        return base

    @property
    def has_unpublished(self) -> bool:
        return self._unpublished is not None or self.is_reducing

    @property
    def sharded_grad(self) -> Optional[torch.Tensor]:
        kept = self._kept
        if kept is not None:
            return None if kept.is_free else kept.base
        return None if self._published is None else self._published()

    def kept_views(self) -> Optional[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        kept = self._kept
        return None if kept is None or kept.released else (kept.base, kept.views)

    def publish(self, used: Sequence[bool]) -> list[nn.Parameter]:
        """Unpublished -> published; returns the used parameters. Pre-condition: none in
        flight."""
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
        if self._every_param_receives and all(used):
            for param, view in zip(self._params, views):
                param.grad = view
            return list(self._params)
        fresh = []
        for record, view, receives, was_used in zip(owner.records, views, owner.grad_receivers,
                                                    used):
            if not receives:
                continue  # holds none of it ([Note: used parameters])
            param = record.param
            if was_used:
                param.grad = view
                fresh.append(param)
            elif param.grad is not None:
                param.grad = view
        return fresh

    def assert_consistent(self) -> None:
        """Assert [Note: the states of a flat gradient]."""
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
        """Adopt ``grad`` as published for the parameters in ``has_grad``."""
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
    return tensor.storage_offset() == 0 and \
        tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def _in_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


class KeptGradient:
    """A sharded gradient and its ``.grad`` views. Invariant: ``baseline`` is
    :meth:`holders` with no outside holder."""

    __slots__ = ("base", "views", "storage", "key", "nbytes", "baseline", "released")

    def __init__(self, base: torch.Tensor,
                 make_views: Callable[[torch.Tensor], Sequence[torch.Tensor]]) -> None:
        self.base: torch.Tensor = base
        self.views: tuple[torch.Tensor, ...] = tuple(make_views(base))
        self.storage: torch.UntypedStorage = base.untyped_storage()
        self.key: int = storage_key(self.storage)
        self.nbytes: int = self.storage.nbytes()
        self.released: bool = False
        self.baseline: int = 0
        self.baseline = self.holders()

    def holders(self) -> int:
        """References to the views and their memory."""
        views = self.views
        return (storage_key_use_count(self.key) + sum(map(tensor_use_count, views))
                + sum(map(sys.getrefcount, views)))

    @property
    def is_free(self) -> bool:
        return self.released or self.holders() == self.baseline

    def release(self) -> None:
        """Pre-condition: :attr:`is_free`."""
        self.storage.resize_(0)
        self.released = True

    def take_memory_of(self, tensor: torch.Tensor) -> bool:
        """Take an unshared storage's memory without a copy; whether it did."""
        if not CAN_SWAP_STORAGE_DATA or tensor.storage_offset():
            return False
        storage = tensor.untyped_storage()
        if storage.nbytes() != self.nbytes or storage_use_count(storage) != 2:
            return False
        swap_storage_data(self.storage, storage)
        self.released = False
        return True

    def reclaim(self) -> torch.Tensor:
        """The base, its memory back. Pre-condition: :attr:`is_free`."""
        if self.released:
            self.storage.resize_(self.nbytes)
            self.released = False
        return self.base
