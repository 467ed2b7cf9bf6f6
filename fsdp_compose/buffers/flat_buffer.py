"""One flat buffer: the storage and views of a group of parameters.

[Note: storage and autograd]
The unsharded buffer is a leaf tensor; reshard resizes its *storage* to 0 bytes and unshard
gathers into it again, so views autograd saved stay valid and hold no memory while sharded.
The views' node is rebuilt every recorded forward: one built once would fire the
post-backward hook only at the end of backward.
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn as nn

from .._torch_private import unsafe_set_version_counter
from ..comm.custom import UnitComms
from ..comm.groups import ShardGroup
from ..comm.custom import CustomWire
from ..comm.quantized import policy_wire
from ..comm.wire import EXACT, Wire
from .flat_grad import FlatGradient
from .layout import OWNED, FlatLayout, ShardSlice
from .param_views import (ParamSlots, Strided, ViewPlan, called_weakly, split_into_params,
                          split_plan, strided_view)
from .records import BufferPolicy, ParamRecord, buffer_layout, is_aliased, resolve_dtypes
from .staging import StagingPool
from .tensor_parallel import as_dtensor


class _PostForwardCopy(NamedTuple):

    group: ShardGroup
    piece: torch.Tensor
    versions: tuple[int, ...]


class FlatBuffer:
    """Invariants: ``sharded`` is the only persistent storage of the values (each ``.data``
    its :meth:`local_view`); ``unsharded`` has storage only while ``is_unsharded``, unless
    ``aliased`` or ``keeps_unsharded_storage``."""

    __slots__ = ('aliased', 'compute_device', 'compute_dtype', 'dtype', 'is_gathering', 'grad', 'group', 'is_meta', 'is_unsharded', 'keeps_unsharded_storage',
                 'layout', 'pin_memory', 'policy', 'records', 'reduce_comm_dtype',
                 'reduce_dtype', 'requires_grad',
                 'reshard_frees_nothing', 'sharded', 'slots', 'staging', 'storage_device',
                 'unsharded', 'wire', '_alias_versions', '_aliases',
                 '_before_flat_gradient', '_grad_hook_registered', '_grad_receivers',
                 '_has_copies', '_has_tp', '_local_shapes', '_local_split',
                 '_local_strided', '_moved_dims', '_on_backward',
                 '_param_requires_grad', '_params', '_post_accumulate_grad',
                 '_post_forward', '_sharded_views', '_slices',
                 '_versions_at_unshard', '_view_plan', '__dict__', '__weakref__')

    def __init__(self, records: list[ParamRecord], group: ShardGroup,
                 post_accumulate_grad: Optional[Callable[["FlatBuffer"], None]] = None,
                 policy: BufferPolicy = BufferPolicy(),
                 before_flat_gradient: Optional[Callable[["FlatBuffer"], None]] = None) -> None:
        if not records:
            raise AssertionError("a flat buffer needs at least one parameter")
        self.records: list[ParamRecord] = records
        self.group: ShardGroup = group
        self.layout: FlatLayout = buffer_layout(records, group.world_size, policy)
        self._slices: tuple[ShardSlice, ...] = self.layout.shard_slices(group.rank)
        self._local_shapes: tuple[tuple[int, ...], ...] = tuple(
            self.layout.local_shape(i, group.rank) for i in range(len(records)))
        self._moved_dims: tuple[int, ...] = self.layout.moved_dims()
        self._local_strided: tuple[Strided, ...] = tuple(
            strided_view(shape, d, s.shard_start)
            for shape, d, s in zip(self._local_shapes, self._moved_dims, self._slices))
        self._local_split: Optional[tuple[list[int], list[int]]] = split_plan(
            self._local_strided, self.layout.shard_numel)
        self._params: tuple[nn.Parameter, ...] = tuple(r.param for r in records)
        self.slots: ParamSlots = ParamSlots(records)
        self._view_plan: ViewPlan = ViewPlan(self.layout, self._moved_dims)
        self._has_tp: bool = any(r.tp is not None for r in records)
        self._has_copies: bool = not all(
            self.layout.is_contiguous(i) for i in range(len(records)))
        self._param_requires_grad: tuple[bool, ...] = tuple(
            r.param.requires_grad for r in records)
        self.requires_grad: bool = any(self._param_requires_grad)
        self._post_accumulate_grad = post_accumulate_grad
        self._before_flat_gradient = before_flat_gradient
        self.policy: BufferPolicy = policy

        self.dtype: torch.dtype
        self.compute_dtype: torch.dtype
        self.reduce_dtype: torch.dtype
        self.reduce_comm_dtype: torch.dtype
        self.wire: Wire = EXACT
        self.compute_device: torch.device = group.device
        self.storage_device: torch.device
        self.pin_memory: bool
        self.sharded: torch.Tensor
        self.unsharded: torch.Tensor
        self.aliased: bool
        self._sharded_views: list[torch.Tensor]
        self._aliases: Optional[tuple[torch.Tensor, ...]]
        """[Note: parameter aliases made once]; ``None``: views per forward."""
        self._alias_versions: Optional[tuple[int, ...]]
        self.is_unsharded: bool = False
        self.is_gathering: bool = False
        """From :meth:`prepare_unshard` to :meth:`complete_gather`."""
        self.staging: Optional[StagingPool] = None
        self.keeps_unsharded_storage: bool = False
        """``set_keep_unsharded_storage``."""
        self._post_forward: Optional[_PostForwardCopy] = None
        self._versions_at_unshard: tuple[int, ...] = ()
        """The parameters' versions at the unshard."""
        self._grad_receivers: tuple[bool, ...] = tuple(
            bool(s.length) or self.grad_where_empty(i) for i, s in enumerate(self._slices))
        self.grad: FlatGradient = FlatGradient(self)
        self._on_backward = called_weakly(self._views_backward)
        self._install(self._shard_values(records[0].param.dtype))

    def _shard_values(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's slice of every parameter in a new shard."""
        device = torch.device("meta") if self.records[0].param.is_meta else self._storage_device()
        shard = torch.zeros(self.layout.shard_numel, dtype=dtype, device=device,
                            pin_memory=self._pinned(device))
        if device.type == "meta":
            return shard
        for index, (record, s) in enumerate(zip(self.records, self._slices)):
            if s.length:
                d = self._moved_dims[index]
                value = record.param.detach()
                flat = (value.movedim(d, 0) if d else value).reshape(-1)
                shard[s.shard_start:s.shard_start + s.length].copy_(
                    flat[s.param_start:s.param_start + s.length])
        return shard

    def local_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """A view in its local shape."""
        if flat.stride(0) == 1:
            size, stride, offset = self._local_strided[index]
            return flat.as_strided(size, stride, flat.storage_offset() + offset)
        s = self._slices[index]
        view = flat.narrow(0, s.shard_start, s.length).view(self._local_shapes[index])
        d = self._moved_dims[index]
        return view.movedim(0, d) if d else view

    def local_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`local_view` of every parameter of a contiguous ``flat``."""
        if self._local_split is not None:
            sizes, picks = self._local_split
            parts = flat.split_with_sizes(sizes)
            return [parts[i] for i in picks]
        base = flat.storage_offset()
        return [flat.as_strided(size, stride, base + offset)
                for size, stride, offset in self._local_strided]

    @property
    def grad_receivers(self) -> tuple[bool, ...]:
        return self._grad_receivers

    def grad_where_empty(self, index: int) -> bool:
        """[Note: used parameters]."""
        return self.layout.placements[index] != OWNED

    def _storage_device(self) -> torch.device:
        return torch.device("cpu") if self.policy.offload_to_cpu else self.group.device

    def _pinned(self, device: torch.device) -> bool:
        return (self.policy.pin_memory and device.type == "cpu"
                and self.compute_device.type != "cpu")

    def _install(self, sharded: torch.Tensor) -> None:
        """Every ``.data`` becomes its slice."""
        dtypes = resolve_dtypes(sharded.dtype, self.policy)
        self.dtype, self.compute_dtype = dtypes.param, dtypes.compute
        self.reduce_dtype, self.reduce_comm_dtype = dtypes.reduce, dtypes.reduce_comm
        moves_floats = dtypes.param.is_floating_point and self.group.world_size > 1
        self.wire = self.wire.on_policy(
            policy_wire(self.policy.gather_quantizer, self.policy.reduce_quantizer)
            if moves_floats else EXACT)
        self.storage_device = sharded.device
        self.pin_memory = self._pinned(self.storage_device)
        self.sharded = sharded
        self.is_meta: bool = sharded.is_meta
        self.aliased = is_aliased(self.group.world_size, dtypes,
                                  self.storage_device == self.compute_device)
        self.reshard_frees_nothing: bool = self.aliased and not self._has_copies
        """A reshard frees nothing."""
        if self.is_meta:
            self.unsharded = torch.empty(self.layout.padded_numel, dtype=self.compute_dtype,
                                         device="meta", requires_grad=self.requires_grad)
            self._derive_views(sharded)
        elif self.aliased:
            self.unsharded = torch.empty(0, dtype=self.dtype, device=self.compute_device)
            with torch.no_grad():
                self.unsharded.set_(sharded.untyped_storage(), 0, (self.layout.padded_numel,),
                                    (1,))
            self.unsharded.requires_grad_(self.requires_grad)
            self._derive_views(sharded)
        else:
            self.unsharded = torch.empty(
                self.layout.padded_numel, dtype=self.compute_dtype, device=self.compute_device,
                requires_grad=self.requires_grad)
            self._derive_views(sharded)
            self.unsharded.untyped_storage().resize_(0)
        self.is_unsharded = False
        for record, view in zip(self.records, self._sharded_views):
            record.param.data = view

    def _derive_views(self, sharded: torch.Tensor) -> None:
        """Built while the storage is whole."""
        self._grad_hook_registered = False
        self._register_grad_hook()
        self._sharded_views = [self.local_view(sharded, i) for i in range(len(self.records))]
        self._aliases = None if self.is_meta else self._view_plan.aliases(self.unsharded)
        self._alias_versions = None
        if self._has_copies and not self.is_meta:
            self._view_plan.make_copies(self.unsharded)
        self.slots.set_views(self._build_unsharded_views())

    def add_slot(self, index: int, module: nn.Module, name: str) -> None:
        """Parameter ``index`` is ``module.<name>`` too. Pre-condition: sharded."""
        if self.is_unsharded or module._parameters.get(name) is not self.records[index].param:
            raise AssertionError(f"[rank {self.group.rank}] add_slot needs a sharded buffer "
                                 f"and the original parameter in '{name}'")
        self.slots.add(index, module, name)

    def _register_grad_hook(self) -> None:
        if self.requires_grad and not self._grad_hook_registered and \
                self._post_accumulate_grad is not None:
            # weak: C++ hook lists
            self.unsharded.register_post_accumulate_grad_hook(
                called_weakly(self._post_accumulate_grad, weakref.ref(self)))
            self._grad_hook_registered = True

    def _build_unsharded_views(self) -> list[torch.Tensor]:
        """[Note: one backward node per buffer], [Note: assembled copies]."""
        if self.requires_grad:
            if torch.is_grad_enabled():
                views = self._differentiable_views()
            else:
                with torch.enable_grad():
                    views = self._differentiable_views()
        else:
            with torch.no_grad():
                views = self._view_plan.views(self.unsharded)
        if not self._has_tp:
            return views
        return [view if record.tp is None else as_dtensor(view, record.tp)
                for view, record in zip(views, self.records)]

    def _differentiable_views(self) -> list[torch.Tensor]:
        flags = self._param_requires_grad
        aliases = self._aliases if all(flags) else None
        views = split_into_params(self.unsharded, self._view_plan, flags, self._on_backward, aliases)
        if aliases is not None:
            self._alias_versions = tuple(alias._version for alias in aliases)
        return list(views)

    def check_params_unmodified(self) -> None:
        """Raise if forward changed a parameter in place."""
        recorded, self._alias_versions = self._alias_versions, None
        if recorded is None or tuple(alias._version for alias in self._aliases) == recorded:
            return
        index = next(i for i, (alias, version) in enumerate(zip(self._aliases, recorded))
                     if alias._version != version)
        raise RuntimeError(
            f"parameter '{self.records[index].fqn}' was modified in place during forward. "
            "fully_shard hands forward a copy of the all-gathered values, so the change would "
            "not reach the sharded parameter (and autograd would not see it as a change of a "
            "parameter). Compute a new tensor instead (e.g. w = self.weight * 2), or change the "
            "parameter between steps under torch.no_grad().")

    def _views_backward(self, param_grads: Sequence[Optional[torch.Tensor]]) -> None:
        self.grad.mark_used(param_grads)
        if self._before_flat_gradient is not None:
            self._before_flat_gradient(self)

    def start_recorded_forward(self) -> bool:
        """New views for a recorded forward; returns ``requires_grad``."""
        if tuple(param.requires_grad for param in self._params) == self._param_requires_grad:
            self.grad.saw_forward = True
        else:
            self.sync_requires_grad()
        if not self.requires_grad:
            return False
        aliases = self._aliases
        if aliases is not None and not self._has_tp and all(self._param_requires_grad):
            # only the node is new
            split_into_params(self.unsharded, self._view_plan, self._param_requires_grad,
                              self._on_backward, aliases)
            self._alias_versions = tuple(alias._version for alias in aliases)
        else:
            self.refresh_views()
        return True

    def sync_requires_grad(self) -> None:
        """Follow ``requires_grad`` changes since the last forward."""
        flags = tuple(param.requires_grad for param in self._params)
        if flags == self._param_requires_grad:
            self.grad.saw_forward = True
            return
        self._param_requires_grad = flags
        self.grad.note_training(flags)
        self.grad.saw_forward = True
        self.requires_grad = any(flags)
        self.unsharded.requires_grad_(self.requires_grad)
        self._register_grad_hook()
        self.slots.set_views(self._build_unsharded_views())
        if self.is_unsharded:
            self.use_unsharded_views()

    def rebuild_after_conversion(self) -> bool:
        """After ``_apply``; whether anything changed. Pre-condition: sharded."""
        params = [r.param for r in self.records]
        if all(p.dtype == self.dtype and p.device == self.storage_device
               and (v.numel() == 0 or p.data_ptr() == v.data_ptr())
               for p, v in zip(params, self._sharded_views)):
            return False
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if self.is_meta and len(devices) == 1 and torch.device("meta") not in devices:
            devices = {self._storage_device()}  # materialised
        if len(dtypes) > 1 or devices != {self.storage_device} and not self.is_meta or \
                len(devices) > 1:
            described = ", ".join(f"'{r.fqn}': {r.param.dtype} on {r.param.device}"
                                  for r in self.records)
            raise ValueError(
                f"after a module conversion the parameters of one flat buffer disagree or left "
                f"the mesh's device {self.storage_device} ({described}). fully_shard supports "
                "dtype conversions of the whole unit (module.to(dtype), .double(), .bfloat16()); "
                "move the model to its device before fully_shard.")
        dtype, device = dtypes.pop(), devices.pop()
        shard = torch.zeros(self.layout.shard_numel, dtype=dtype, device=device,
                            pin_memory=self._pinned(device))
        grads = [p.grad for p in params]
        grad = None
        if any(g is not None for g in grads):
            grad = torch.zeros_like(shard)
        # Leaving meta: keep the zeros, so replicas agree.
        leaving_meta = self.is_meta
        for index, (param, g, s) in enumerate(zip(params, grads, self._slices)):
            if s.length and device.type != "meta" and not leaving_meta:
                self.local_view(shard, index).copy_(param.detach())
                if g is not None:
                    self.local_view(grad, index).copy_(g)
        self.grad.discard_unreduced()
        for param in params:
            param.grad = None
        self._install(shard)
        self.grad.attach(grad, [g is not None for g in grads])
        return True

    def prepare_unshard(self, coalescable: bool = False, defer_storage: bool = False
                        ) -> Optional[tuple[torch.Tensor, ShardGroup]]:
        """What to gather over which group (``None``: nothing). Pre-condition: not ``aliased``."""
        if self.is_gathering:
            return None
        if coalescable and self._post_forward is not None:
            return None
        if self.is_unsharded:
            if not self.is_stale:
                return None  # already unsharded
            # kept across an optimizer step: gather again
            self.reshard()
        if not defer_storage:
            self.allocate_unsharded()
        kept, self._post_forward = self._post_forward, None
        if kept is not None and kept.versions == self._param_versions():
            shard, group = kept.piece, kept.group
        else:
            shard, group = self.gather_input(), self.group
        self.is_gathering = True
        return shard, group

    def unshard_in_place(self) -> None:
        """Pre-condition: ``aliased``, sharded."""
        self.is_unsharded = True
        self.slots.swap_in_views()

    def keep_unsharded_storage(self, keep: bool) -> None:
        self.keeps_unsharded_storage = keep
        if not keep and not self.is_unsharded and not self.aliased and not self.is_gathering \
                and self.unsharded.untyped_storage().nbytes():
            self._release_unsharded_storage()

    def allocate_unsharded(self) -> None:
        nbytes = self.layout.padded_numel * self.unsharded.element_size()
        storage = self.unsharded.untyped_storage()
        if self.keeps_unsharded_storage:
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
            return
        if self.staging is not None:
            self.staging.fill(self.unsharded.untyped_storage(), nbytes)
        else:
            self.unsharded.untyped_storage().resize_(nbytes)

    def unsharded_storage_ptrs(self) -> set[int]:
        ptrs = {self.unsharded.untyped_storage().data_ptr()}
        copies = self._view_plan.copies_storage_ptr()
        if copies is not None:
            ptrs.add(copies)
        return ptrs

    def gather_input(self) -> torch.Tensor:
        return self.sharded.to(self.compute_device, self.compute_dtype, non_blocking=True)

    def complete_gather(self, version: int) -> None:
        """``version``: before the all-gather."""
        unsafe_set_version_counter((self.unsharded,), (version,))
        self.is_gathering = False
        self.is_unsharded = True
        self._versions_at_unshard = self._param_versions()
        if self._has_copies:
            self._view_plan.fill_copies(self.unsharded)
            if self._view_plan.copies_only:
                self._release_unsharded_storage()
            self.slots.set_views(self._build_unsharded_views())
        self.slots.swap_in_views()

    @property
    def comms(self) -> Optional[UnitComms]:
        wire = self.wire
        return wire.comms if isinstance(wire, CustomWire) else None

    @property
    def is_stale(self) -> bool:
        return self.is_unsharded and not self.aliased and \
            self._versions_at_unshard != self._param_versions()

    def _param_versions(self) -> tuple[int, ...]:
        return tuple(r.param._version for r in self.records)

    def refresh_views(self) -> None:
        """Pre-condition: unsharded, grad mode on."""
        self.slots.set_views(self._build_unsharded_views())
        self.use_unsharded_views()

    def use_unsharded_views(self) -> None:
        self.slots.put_views()

    def reshard(self, keep_for_backward: Optional[ShardGroup] = None) -> None:
        """Originals back, storage freed. Pre-condition: no all-gather in flight."""
        if self.is_gathering:
            raise AssertionError(f"[rank {self.group.rank}] resharding a buffer of "
                                 f"'{self.records[0].fqn}' while its all-gather is in flight")
        if not self.is_unsharded:
            return
        if keep_for_backward is not None:
            if self.unsharded.untyped_storage().nbytes() == 0:  # released
                self.allocate_unsharded()
                self._view_plan.unfill_copies(self.unsharded)
            size = self.layout.padded_numel // keep_for_backward.world_size
            piece = self.unsharded.detach().narrow(
                0, keep_for_backward.rank * size, size).clone()
            self._post_forward = _PostForwardCopy(keep_for_backward, piece,
                                                  self._versions_at_unshard)
        self.slots.put_originals()
        self.is_unsharded = False
        if self._has_copies:
            self._view_plan.free_copies()
        if self.aliased:
            return
        self._release_unsharded_storage()

    def _release_unsharded_storage(self) -> None:
        if self.keeps_unsharded_storage:
            return
        if self.staging is not None:
            self.staging.drain(self.unsharded.untyped_storage())
        else:
            self.unsharded.untyped_storage().resize_(0)

    def drop_post_forward_copy(self) -> None:
        self._post_forward = None

    def full_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        with torch.no_grad():
            return self._view_plan.views(flat)

    def local_slices(self) -> tuple[ShardSlice, ...]:
        return self._slices

    def __repr__(self) -> str:
        kind = "trainable" if self.requires_grad else "frozen"
        return f"FlatBuffer({kind}, {self.dtype}, {len(self.records)} params, {self.layout})"
