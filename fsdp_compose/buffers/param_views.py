"""The per-parameter views of an unsharded flat buffer, as one autograd
node; the module attributes they go in (:class:`ParamSlots`); and the hooks
autograd keeps of a buffer (:func:`called_weakly`).

[Note: one backward node per buffer]
:class:`SplitIntoParams` makes every view in one node (not one per parameter), whose backward
gets every gradient (``None``: unused) and concatenates them.

[Note: assembled copies]
Parameters that are not one run (``ShardDim``) are copied at every unshard into a storage
freed at reshard, so a saved copy holds no memory until backward's all-gather.

[Note: parameter aliases made once]
Where every parameter is one run and all train, the outputs are made once
(:meth:`ViewPlan.aliases`) on the unsharded storage. Not being views, their version counters
are checked after each forward.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn as nn

from .._torch_private import flatten_dense_tensors, functorch_transforms_active
from .layout import FlatLayout
from .records import ParamRecord

class Strided(NamedTuple):

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def strided_view(stored_shape: Sequence[int], moved_dim: int, offset: int) -> Strided:
    """The ``as_strided`` view of a run at ``offset``."""
    meta = torch.empty(tuple(stored_shape), device="meta")
    if moved_dim:
        meta = meta.movedim(0, moved_dim)
    return Strided(tuple(meta.shape), tuple(meta.stride()), offset)


def split_plan(views: Sequence[Strided], numel: int) -> Optional[tuple[list[int], list[int]]]:
    """Split sizes when ``views`` are 1-D runs in order; else ``None``."""
    sizes: list[int] = []
    picks: list[int] = []
    position = 0
    for size, stride, offset in views:
        if len(size) != 1:
            return None
        if size[0] == 0:
            picks.append(len(sizes))
            sizes.append(0)
            continue
        if stride != (1,) or offset < position:
            return None
        if offset > position:
            sizes.append(offset - position)  # padding
        picks.append(len(sizes))
        sizes.append(size[0])
        position = offset + size[0]
    if position > numel:
        return None
    if position < numel:
        sizes.append(numel - position)
    return sizes, picks


UsedCallback = Callable[[Sequence[Optional[torch.Tensor]]], None]


class ViewPlan:
    """Views of a flat buffer, and their gradients joined."""

    __slots__ = ("split_sizes", "segment_params", "segment_param_starts", "param_segments",
                 "moved_dims", "contiguous", "max_padding", "_strided", "_stored_shapes",
                 "_all_strided", "_direct_parts", "_grads_in_order", "_copy_runs", "copy_numel",
                 "copies", "copies_only")

    def __init__(self, layout: FlatLayout, moved_dims: Sequence[int]) -> None:
        segments = layout.segments()
        self.split_sizes: list[int] = [s.length for s in segments]
        self.segment_params: tuple[int, ...] = tuple(s.param_index for s in segments)
        self.segment_param_starts: tuple[int, ...] = tuple(s.param_start for s in segments)
        param_segments: list[list[int]] = [[] for _ in layout.shapes]
        for index, segment in enumerate(segments):
            if segment.param_index >= 0:
                param_segments[segment.param_index].append(index)
        self.param_segments: tuple[tuple[int, ...], ...] = tuple(tuple(s) for s in param_segments)
        self.moved_dims: tuple[int, ...] = tuple(moved_dims)
        self.contiguous: tuple[bool, ...] = tuple(len(s) <= 1 for s in self.param_segments)
        self.max_padding: int = max((s.length for s in segments if s.param_index < 0), default=0)
        self._stored_shapes = layout.stored_shapes
        self._strided: tuple[Optional[Strided], ...] = tuple(
            strided_view(shape, d, segments[segs[0]].start if segs else 0) if len(segs) <= 1
            else None
            for shape, d, segs in zip(layout.stored_shapes, moved_dims, self.param_segments))
        """Per parameter (``None``: assembled)."""
        self._all_strided: Optional[tuple[Strided, ...]] = tuple(self._strided) \
            if all(s is not None for s in self._strided) else None
        self._direct_parts: Optional[tuple[tuple[int, int], ...]] = tuple(
            (param, length) for param, length in zip(self.segment_params, self.split_sizes)) \
            if all(self.contiguous) and not any(self.moved_dims) else None
        """Per segment ``(parameter or -1, length)``, when all are runs."""
        self._grads_in_order: bool = self._direct_parts is not None and \
            [param for param, _ in self._direct_parts] == list(range(len(layout.shapes))) and \
            len(layout.shapes) > 0
        starts = [0]
        for size in self.split_sizes:
            starts.append(starts[-1] + size)
        runs, position = [], 0
        for index, strided in enumerate(self._strided):
            if strided is None:  # see [Note: assembled copies]
                pieces = tuple((starts[s], self.split_sizes[s]) for s in self.param_segments[index])
                runs.append((index, strided_view(self._stored_shapes[index], moved_dims[index],
                                                 position), pieces))
                position += sum(length for _, length in pieces)
        self._copy_runs: tuple[tuple[int, Strided, tuple[tuple[int, int], ...]], ...] = \
            tuple(runs)
        self.copy_numel: int = position
        self.copies_only: bool = bool(runs) and len(runs) == len(self._strided)
        """Every parameter is a copy."""
        self.copies: Optional[tuple[torch.Tensor, dict[int, torch.Tensor]]] = None

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter in its shape (a view, else a copy); no autograd history."""
        base = flat.storage_offset()
        if self._all_strided is not None:
            as_strided = flat.as_strided
            return [as_strided(size, stride, base + offset)
                    for size, stride, offset in self._all_strided]
        out = []
        copies = self.copies[1] if self.copies is not None else None
        for index, strided in enumerate(self._strided):
            if strided is not None:
                out.append(flat.as_strided(strided.size, strided.stride, base + strided.offset))
                continue
            if copies is not None:
                out.append(copies[index])
                continue
            whole = torch.cat([flat.narrow(0, *self._segment_range(s))
                               for s in self.param_segments[index]])
            view = whole.view(self._stored_shapes[index])
            d = self.moved_dims[index]
            out.append(view.movedim(0, d) if d else view)
        return out

    def aliases(self, flat: torch.Tensor) -> Optional[tuple[torch.Tensor, ...]]:
        """[Note: parameter aliases made once]; ``None`` unless all are runs."""
        if self._all_strided is None:
            return None
        storage, base = flat.untyped_storage(), flat.storage_offset()
        with torch.no_grad():
            return tuple(flat.new_empty(0).set_(storage, base + offset, size, stride)
                         for size, stride, offset in self._all_strided)

    def make_copies(self, flat: torch.Tensor) -> None:
        """Set :attr:`copies` ([Note: assembled copies])."""
        if not self._copy_runs:
            return
        with torch.no_grad():
            whole = flat.new_empty(self.copy_numel)
            storage = whole.untyped_storage()
            outputs = {index: flat.new_empty(0).set_(storage, strided.offset, strided.size,
                                                     strided.stride)
                       for index, strided, _ in self._copy_runs}
        storage.resize_(0)
        self.copies = (whole, outputs)

    def fill_copies(self, flat: torch.Tensor) -> None:
        if self.copies is None:
            return
        whole = self.copies[0]
        whole.untyped_storage().resize_(self.copy_numel * whole.element_size())
        with torch.no_grad():
            for _, strided, pieces in self._copy_runs:
                position = strided.offset
                for start, length in pieces:
                    whole.narrow(0, position, length).copy_(flat.detach().narrow(0, start, length))
                    position += length

    def unfill_copies(self, flat: torch.Tensor) -> None:
        if self.copies is None:
            return
        whole = self.copies[0]
        with torch.no_grad():
            for _, strided, pieces in self._copy_runs:
                position = strided.offset
                for start, length in pieces:
                    flat.detach().narrow(0, start, length).copy_(whole.narrow(0, position, length))
                    position += length

    def free_copies(self) -> None:
        if self.copies is not None:
            self.copies[0].untyped_storage().resize_(0)

    def copies_storage_ptr(self) -> Optional[int]:
        return None if self.copies is None else self.copies[0].untyped_storage().data_ptr()

    def _segment_range(self, segment: int) -> tuple[int, int]:
        return sum(self.split_sizes[:segment]), self.split_sizes[segment]

    def flat_gradient(self, grads: Sequence[Optional[torch.Tensor]], dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
        """One concatenation (``None``: zeros)."""
        if self._direct_parts is not None and all(grad is not None for grad in grads):
            if self._grads_in_order:
                return flatten_dense_tensors(grads)
            padding = _padding(self.max_padding, dtype, device)
            parts = [grads[param] if param >= 0 else padding[:length]
                     for param, length in self._direct_parts]
            return flatten_dense_tensors(parts)
        padding = _padding(self.max_padding, dtype, device)
        parts = []
        for param, start, length in zip(self.segment_params, self.segment_param_starts,
                                        self.split_sizes):
            if param < 0:
                parts.append(padding[:length])
                continue
            grad = grads[param]
            if grad is None:
                parts.append(padding.new_zeros(length))
            elif self.contiguous[param] and not self.moved_dims[param]:
                parts.append(grad)
            else:
                d = self.moved_dims[param]
                stored = (grad.movedim(d, 0) if d else grad).reshape(-1)
                parts.append(stored if self.contiguous[param] else stored[start:start + length])
        return flatten_dense_tensors(parts) if parts else padding.new_zeros(0)


class SplitIntoParams(torch.autograd.Function):
    """[Note: one backward node per buffer]; a new node per recorded forward ([Note: storage
    and autograd] in ``flat_buffer.py``)."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, plan: ViewPlan,  # type: ignore[override]
                trainable: Sequence[bool], on_backward: UsedCallback,
                aliases: Optional[tuple[torch.Tensor, ...]] = None) -> tuple[torch.Tensor, ...]:
        ctx.materialize_grads = False
        ctx.plan, ctx.on_backward = plan, on_backward
        ctx.dtype, ctx.device = flat.dtype, flat.device
        if aliases is not None:
            return aliases
        views = plan.views(flat)
        if not all(trainable):
            # detached
            views = [v if t else v.detach() for v, t in zip(views, trainable)]
            ctx.mark_non_differentiable(*(v for v, t in zip(views, trainable) if not t))
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):  # type: ignore[override]
        ctx.on_backward(grads)
        return ctx.plan.flat_gradient(grads, ctx.dtype, ctx.device), None, None, None, None


_apply_unwrapped = super(torch.autograd.Function, SplitIntoParams).apply
"""``Function.apply`` without its functorch unwrapping."""


def split_into_params(flat: torch.Tensor, plan: ViewPlan, trainable: Sequence[bool],
                      on_backward: UsedCallback,
                      aliases: Optional[tuple[torch.Tensor, ...]] = None) -> tuple[torch.Tensor, ...]:
    """One output per parameter, or ``aliases``."""
    if functorch_transforms_active():
        return SplitIntoParams.apply(flat, plan, trainable, on_backward)
    return _apply_unwrapped(flat, plan, trainable, on_backward, aliases)


_PADDING: dict[tuple, torch.Tensor] = {}
"""Read-only padding zeros per dtype, device and stream."""

_CACHED_PADDING = 1 << 16


def _padding(count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if count > _CACHED_PADDING:
        return torch.zeros(count, dtype=dtype, device=device)
    # per stream: reads are unordered across streams
    key = (dtype, device) if device.type == "cpu" else \
        (dtype, device, torch.accelerator.current_stream(device))
    zeros = _PADDING.get(key)
    if zeros is None or zeros.numel() < count:
        zeros = torch.zeros(max(count, 1), dtype=dtype, device=device)
        _PADDING[key] = zeros
    return zeros


def called_weakly(fn: Callable[[Any], Any],
                   bound: Optional[Callable[[], Any]] = None) -> Callable[[Any], Any]:
    """``fn``, its object held weakly (hooks in C++ make uncollectable
    cycles); with ``bound``, called with ``bound()``."""
    owner = getattr(fn, "__self__", None)
    ref, function = (weakref.ref(owner), getattr(fn, "__func__")) if owner is not None else \
        ((lambda: _NO_OWNER), (lambda _owner, arg: fn(arg)))

    def call(arg):
        target = ref()
        if bound is not None:
            arg = bound()
        if target is None or arg is None:
            return None
        return function(target, arg)

    return call


_NO_OWNER = object()  # a plain function's "owner"


ModuleSlots = tuple[tuple[dict, dict], ...]
"""``(module._parameters, {name: value})`` per module."""


class ParamSlots:
    """Every ``(module._parameters, name)`` a buffer's parameters are registered under."""

    __slots__ = ("records", "originals", "views_by_module", "_slots", "_dicts", "_names",
                 "_held", "_views")

    def __init__(self, records: Sequence[ParamRecord]) -> None:
        self.records: Sequence[ParamRecord] = records
        self.views_by_module: ModuleSlots = ()
        self._views: Sequence[torch.Tensor] = ()
        self._index()

    def _index(self) -> None:
        records = self.records
        self._slots: tuple[tuple[dict, str, int], ...] = tuple(
            (module._parameters, name, index)
            for index, record in enumerate(records) for module, name in record.slots)
        self.originals: ModuleSlots = self._by_module([r.param for r in records])
        self._dicts: tuple[dict, ...] = tuple(parameters for parameters, _, _ in self._slots)
        self._names: tuple[str, ...] = tuple(name for _, name, _ in self._slots)
        self._held: tuple[nn.Parameter, ...] = tuple(
            records[index].param for _, _, index in self._slots)
        if self._views:
            self.views_by_module = self._by_module(self._views)

    def add(self, index: int, module: nn.Module, name: str) -> None:
        """Parameter ``index`` is ``module.<name>`` too (tied)."""
        self.records[index].slots.append((module, name))
        self._index()

    def _by_module(self, values: Sequence[object]) -> ModuleSlots:
        by_module: dict[int, tuple[dict, dict]] = {}
        for parameters, name, index in self._slots:
            by_module.setdefault(id(parameters), (parameters, {}))[1][name] = values[index]
        return tuple(by_module.values())

    def set_views(self, views: Sequence[torch.Tensor]) -> None:
        self._views = views
        self.views_by_module = self._by_module(views)

    def swap_in_views(self) -> None:
        """Sharded -> unsharded. Raises if a slot holds another ``nn.Parameter``."""
        for parameters, name, original in zip(self._dicts, self._names, self._held):
            if parameters.get(name) is not original:
                self._check_not_replaced()
                break
        self.put_views()

    def put_views(self) -> None:
        for parameters, views in self.views_by_module:
            parameters.update(views)

    def put_originals(self) -> None:
        for parameters, originals in self.originals:
            parameters.update(originals)

    def _check_not_replaced(self) -> None:
        """Raise naming the replaced parameter."""
        for parameters, name, index in self._slots:
            held = parameters.get(name)
            record = self.records[index]
            if held is record.param or not isinstance(held, nn.Parameter):
                continue
            module = next(m for m, attr in record.slots
                          if m._parameters is parameters and attr == name)
            raise RuntimeError(
                f"parameter '{record.fqn}' (attribute '{name}' of {type(module).__name__}) was "
                "replaced after fully_shard annotated it, by a write into _parameters; "
                "fully_shard does not manage the new one, and would put the original back over "
                "it at the next reshard. Register parameters before calling fully_shard; to give "
                "a parameter new values, load them with model.load_state_dict().")
