"""Optimizer state of managed parameters in torch FSDP2's checkpoint layout:
a ``state_dict()`` post-hook makes each per-element state a ``DTensor``
placed as the parameter, a ``load_state_dict()`` pre-hook turns such values
(or full tensors) back into local pieces. A global step pre-hook attaches
them at every optimizer's first step.
"""

from __future__ import annotations

import bisect
import weakref
from itertools import chain
from typing import Any, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._torch_private import local_tensor
from ..buffers.flat_buffer import FlatBuffer
from ..comm.groups import backend_device
from ..comm.rendezvous import arrive
from ..runtime.owners import owner_of
from ._exchange import (Reader, checkpoint_shape, chunks_to_flat, flat_to_chunks, loadable,
                        record_value, shard_dim, shard_dim_local, shard_dim_value)
from ._chunks import chunk_shape
from ._fresh_state import make_first_step_state
from ._exchange import checkpoint_placements
from ._lazy import in_place, is_lazy, lazy_value
from ._pieces import ShardPieces, flat_values_requested, has_pieces

_SEEN: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
_ATTACHED: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
_ZERO_STEPPED: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
"""Optimizers whose last step was torch's state initialisation (``lr`` 0)."""


def register_optimizer(optimizer: Optimizer) -> None:
    """Make ``optimizer.state_dict()`` / ``load_state_dict()`` speak the
    checkpoint layout for managed parameters. Idempotent. For AdamW, Adam and
    SGD that never stepped, ``state_dict()`` first makes their first step's
    state, so loading into it resumes exactly."""
    _SEEN.add(optimizer)
    if optimizer in _ATTACHED or not any(owner_of(p) is not None for p in _params(optimizer)):
        return
    optimizer.register_state_dict_pre_hook(make_first_step_state)
    optimizer.register_state_dict_post_hook(_to_checkpoint_layout)
    optimizer.register_load_state_dict_pre_hook(_from_checkpoint_layout)
    _ATTACHED.add(optimizer)


def _on_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer not in _SEEN:
        register_optimizer(optimizer)
    if not optimizer.state and optimizer in _ATTACHED:
        if _is_zero_initialisation(optimizer):
            _ZERO_STEPPED.add(optimizer)
            return
    if optimizer in _ZERO_STEPPED:
        _ZERO_STEPPED.discard(optimizer)


def note_zero_initialisation(optimizer: Optimizer) -> None:
    """:func:`_on_step` at torch's state initialisation made without the step."""
    register_optimizer(optimizer)
    if optimizer in _ATTACHED:
        _ZERO_STEPPED.add(optimizer)


def _is_zero_initialisation(optimizer: Optimizer) -> bool:
    """The step torch's ``get_state_dict`` takes on an optimizer without state
    (on one rank alone it makes state one process would not save)."""
    if any(float(group.get("lr", 1.0)) != 0.0 for group in optimizer.param_groups):
        return False
    return all(p.grad is not None and not bool(p.grad.any())
               for p in _params(optimizer) if p.requires_grad)


_installed: list[object] = []


def install_optimizer_layout_hooks() -> None:
    if not _installed:
        _installed.append(register_optimizer_step_pre_hook(_on_step))


def _params(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _is_per_element(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
        and value.dim() >= 1 and value.shape == param.shape


class _BufferEntries:

    def __init__(self, buffer: FlatBuffer) -> None:
        self.buffer = buffer
        self.entries: list[tuple[Any, int]] = []


def _by_buffer(params_by_key: dict[Any, torch.Tensor]) -> list[_BufferEntries]:
    groups: dict[int, _BufferEntries] = {}
    for key, param in params_by_key.items():
        owner = owner_of(param)
        if owner is not None:
            groups.setdefault(id(owner.buffer), _BufferEntries(owner.buffer)).entries.append(
                (key, owner.index))
    return list(groups.values())


OPTIM_SAVE_ADVICE = (
    "Sharded optimizer state is spread over the ranks: call it on every rank. To write one "
    "file from rank 0, gather it on every rank and save on rank 0: "
    "`osd = get_optimizer_state_dict(model, optim, options=StateDictOptions("
    "full_state_dict=True, cpu_offload=True))` (from torch.distributed.checkpoint.state_dict), "
    "then `if rank == 0: torch.save(osd, f)`; for sharded saves, call "
    "`torch.distributed.checkpoint.save({'optim': get_optimizer_state_dict(model, optim)}, "
    "checkpoint_id=path)` on every rank (or use CheckpointStore).")


def _to_checkpoint_layout(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    arrive(None, "optimizer.state_dict()", OPTIM_SAVE_ADVICE)
    params = dict(enumerate(_params(optimizer)))
    _drop_zero_step_state(optimizer, state_dict)
    state = state_dict["state"]
    plan = []  # (buffer, state name, [(state key, buffer index)], dtype, device)
    for group in _by_buffer(params):
        names = sorted({name for key, _ in group.entries
                        for name, value in state.get(key, {}).items()
                        if _is_per_element(value, params[key])})
        for name in names:
            entries = [(key, index) for key, index in group.entries if name in state.get(key, {})]
            first = state[entries[0][0]][name]
            plan.append((group.buffer, name, entries, first.dtype, first.device))
    plan, scalars = _same_on_every_rank(plan, params, state)
    for key, values in scalars.items():
        state[key] = {**values, **state.get(key, {})}
    flat = flat_values_requested()
    for buffer, name, entries, dtype, device in plan:
        _refuse_scalar_params(buffer, name, entries)
        for key, _ in entries:
            if key not in state or state[key] is optimizer.state.get(params[key]):
                state[key] = dict(state.get(key, {}))
        if flat:
            for key, index in entries:
                if has_pieces(buffer, index):
                    state[key][name] = ShardPieces.of(buffer, index, state[key].get(name),
                                                      dtype=dtype, lead=buffer.group.rank == 0)
            entries = [(key, i) for key, i in entries if not has_pieces(buffer, i)]
        else:
            for key, index in entries:
                if is_lazy(buffer, index):
                    state[key][name] = _lazy_state(buffer, index, name, state[key].get(name),
                                                   dtype, device)
            entries = [(key, i) for key, i in entries if not is_lazy(buffer, i)]
        exchanged = [(key, i) for key, i in entries if shard_dim(buffer.records[i]) is None]
        chunks = flat_to_chunks(_reader(buffer, name, exchanged, state), buffer.layout,
                                buffer.group, [i for _, i in exchanged], dtype=dtype,
                                home=device) if exchanged else {}
        for key, index in entries:
            record = buffer.records[index]
            if shard_dim(record) is not None:
                local = state[key].get(name)
                if local is None:
                    local = buffer.local_view(torch.empty(buffer.layout.shard_numel, dtype=dtype,
                                                          device=device), index)
                state[key][name] = shard_dim_value(local, record, buffer.group)
                continue
            state[key][name] = record_value(chunks[index], record, buffer.group)
    # the same order on every rank: lazy values convert collectively in dict order
    state_dict["state"] = {key: dict(sorted(state[key].items())) if isinstance(state[key], dict)
                           else state[key] for key in sorted(state, key=repr)}


def _lazy_state(buffer: FlatBuffer, index: int, name: str, local: Optional[torch.Tensor],
                dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    record, group = buffer.records[index], buffer.group
    pieces = ShardPieces.of(buffer, index, local, dtype=dtype, lead=group.rank == 0)

    def convert() -> torch.Tensor:
        held = {0: {name: local}} if local is not None else {}
        read = _reader(buffer, name, [(0, index)] if held else [], held)
        return flat_to_chunks(read, buffer.layout, group, [index], dtype=dtype, home=device)[index]

    return lazy_value(record.shape, chunk_shape(record.shape, group.world_size, group.rank),
                      pieces, local, convert, group, checkpoint_placements(group),
                      f"{name} of {record.fqn}", device)


def _drop_zero_step_state(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Undo torch's state initialisation on ranks that took it while others hold
    trained state (a rank holding none of the trained parameters would save
    ``step`` 1). Collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    initialised = optimizer in _ZERO_STEPPED
    flags = torch.tensor([int(initialised), int(not initialised)], device=backend_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if initialised and bool(flags[1]):
        optimizer.state.clear()
        state_dict["state"] = {}
        _ZERO_STEPPED.discard(optimizer)


def _reader(buffer: FlatBuffer, name: str, entries: list[tuple[Any, int]],
            state: dict[Any, dict[str, Any]]) -> Reader:
    slices = buffer.local_slices()
    owned = sorted((slices[index].shard_start, slices[index].length,
                    state[key][name].reshape(-1))
                   for key, index in entries if slices[index].length)
    starts = [start for start, _, _ in owned]

    def read(start: int, length: int) -> torch.Tensor:
        at = bisect.bisect_right(starts, start) - 1
        param_start, param_length, values = owned[at]
        if not (at >= 0 and param_start <= start and start + length <= param_start + param_length):
            raise AssertionError(f"[rank {buffer.group.rank}] interval ({start}, {length}) of "
                                 f"'{name}' is not inside one parameter's slice")
        return values.narrow(0, start - param_start, length)

    return read


def _refuse_scalar_params(buffer: FlatBuffer, name: str, entries: list[tuple[Any, int]]) -> None:
    for _, index in entries:
        record = buffer.records[index]
        if len(record.shape) == 0:  # the same on every rank: raised everywhere
            raise NotImplementedError(
                f"optimizer state '{name}' of the 0-dim parameter '{record.fqn}' cannot be "
                "checkpointed (its state and 'step' would be indistinguishable). Make the "
                "parameter 1-D (shape (1,)), or pass it to fully_shard's ignored_params.")


def _same_on_every_rank(plan: list, params: dict[Any, torch.Tensor],
                        state: dict[Any, dict[str, Any]]) -> tuple[list, dict[Any, dict]]:
    """Make the collective conversions agree: one object all-gather makes the
    plan the union over ranks. Only state a rank cannot have (a ``.grad``
    that stays ``None`` there) may differ; anything else raises on every
    rank. Also returns a holder's ``step`` where this rank has no state."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return plan, {}
    keys: dict[tuple[str, int], tuple[Any, FlatBuffer]] = {}  # (buffer, index) -> state key
    for key, param in params.items():
        owner = owner_of(param)
        if owner is not None:
            keys[(owner.buffer.records[0].fqn, owner.index)] = (key, owner.buffer)
    summary = [(buffer.records[0].fqn, name, [i for _, i in entries], str(dtype))
               for buffer, name, entries, dtype, _ in plan]
    others = {(b.records[0].fqn, i): {n: _Scalar.of(v) for n, v in state[key].items()
                                     if not _is_per_element(v, params[key])}
              for b, _, entries, _, _ in plan for key, i in entries}
    every: list[Optional[list]] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (summary, others))
    every, held = [e[0] for e in every], [e[1] for e in every]
    union: dict[tuple[str, str], tuple[set[int], str]] = {}
    for other in every:
        for fqn, name, indices, dtype in other or []:
            union.setdefault((fqn, name), (set(), dtype))[0].update(indices)
    mine = {(b.records[0].fqn, name): {i for _, i in entries} for b, name, entries, _, _ in plan}
    merged, consistent = [], True
    for (fqn, name), (indices, dtype) in sorted(union.items()):
        if (fqn, min(indices)) not in keys:
            consistent = False
            continue
        buffer = keys[(fqn, min(indices))][1]
        slices = buffer.local_slices()
        for i in indices - mine.get((fqn, name), set()):
            if (fqn, i) not in keys or slices[i].length or buffer.grad_where_empty(i):
                consistent = False
        if consistent:
            entries = [(keys[(fqn, i)][0], i) for i in sorted(indices)]
            merged.append((buffer, name, entries, getattr(torch, dtype.split(".")[-1]),
                           buffer.storage_device))
    if all(other == summary for other in every):
        agreed = consistent
    else:
        flag = torch.tensor([int(consistent)], device=backend_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # who differs is gathered only on error
        agreed = bool(flag.item())
    if agreed:
        missing = {}
        for _, _, entries, _, _ in merged:
            for key, i in entries:
                if key not in state:
                    fqn = next(f for (f, j), (k, _) in keys.items() if k == key)
                    missing[key] = {n: _Scalar.value(v) for n, v in
                                    next(h[(fqn, i)] for h in held if (fqn, i) in h).items()}
        return merged, missing
    flags: list[Optional[bool]] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, consistent)
    differing = next(r for r, f in enumerate(flags) if not f)
    raise RuntimeError(
        "optimizer.state_dict(): ranks hold per-element optimizer state for different "
        f"parameters (this rank: {_describe(summary)}; rank {differing}: "
        f"{_describe(every[differing])}). Step the optimizer on every rank (e.g. with "
        "gradients of zero) before saving, so that every rank has the same state.")


class _Scalar(NamedTuple):
    """A 0-dim CPU tensor as the all-gather carries it (cheaper than pickling)."""

    number: Union[int, float, bool]
    dtype: torch.dtype

    @staticmethod
    def of(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and \
                value.dim() == 0 and value.device.type == "cpu" and not value.requires_grad:
            return _Scalar(value.item(), value.dtype)
        return value

    @staticmethod
    def value(carried: Any) -> Any:
        if isinstance(carried, _Scalar):
            return torch.tensor(carried.number, dtype=carried.dtype)
        return carried


def _describe(summary: Optional[list]) -> str:
    return ", ".join(f"{name} of {len(indices)} params in the buffer of '{fqn}'"
                     for fqn, name, indices, _ in summary or []) or "none"


def _from_checkpoint_layout(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    arrive(None, "optimizer.load_state_dict()", OPTIM_SAVE_ADVICE)
    _ZERO_STEPPED.discard(optimizer)
    saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = dict(zip(saved_ids, _params(optimizer)))
    state = {key: dict(value) if isinstance(value, dict) else value
             for key, value in state_dict["state"].items()}
    loaded = set()
    for key, values in state.items():
        for name, value in list(values.items()):
            current = optimizer.state.get(params[key], {}).get(name) if key in params else None
            if in_place(value, current):  # a lazy value of ours: loaded in place
                value = local_tensor(value).pieces
            if isinstance(value, ShardPieces):
                loaded.add((key, name))
                if value.local is None:
                    del values[name]  # holds none of it: no state here
                else:
                    values[name] = value.local
    for group in _by_buffer({k: p for k, p in params.items() if k in state}):
        buffer = group.buffer
        names = sorted({name for key, _ in group.entries for name, value in state[key].items()
                        if isinstance(value, torch.Tensor) and value.dim() > 0
                        and (key, name) not in loaded})
        for name in names:
            entries = [(key, index) for key, index in group.entries
                       if isinstance(state[key].get(name), torch.Tensor)
                       and (key, name) not in loaded]
            _load_state(buffer, name, entries, state)
    return {**state_dict, "state": state}


def _load_state(buffer: FlatBuffer, name: str, entries: list[tuple[Any, int]],
                state: dict[Any, dict[str, Any]]) -> None:
    """Replace every entry's ``state[key][name]`` by this rank's piece."""
    slices, group = buffer.local_slices(), buffer.group
    chunks: dict[int, torch.Tensor] = {}
    dtype, device = None, None
    for key, index in entries:
        if shard_dim(buffer.records[index]) is not None:
            state[key][name] = shard_dim_local(state[key][name], buffer.records[index],
                                               group).clone()
            continue
        value, record = state[key][name], buffer.records[index]
        expected = checkpoint_shape(record)
        if tuple(value.shape) != tuple(expected):
            raise ValueError(
                f"optimizer state '{name}' of '{record.fqn}' has shape {tuple(value.shape)}; "
                f"expected the parameter's shape {tuple(expected)} (a DTensor or a full "
                "tensor, as optimizer.state_dict() of an fsdp_compose model produces).")
        chunk, value = loadable(value, record, group)
        if chunk is not None:
            chunks[index] = chunk
            dtype, device = chunk.dtype, chunk.device
            continue
        s = slices[index]
        piece = torch.empty(buffer.layout.shard_numel, dtype=value.dtype, device=value.device)
        piece.narrow(0, s.shard_start, s.length).copy_(
            value.detach().reshape(-1)[s.param_start:s.param_start + s.length])
        state[key][name] = buffer.local_view(piece, index).clone()
    if not chunks:
        return
    flat = torch.empty(buffer.layout.shard_numel, dtype=dtype, device=device)
    chunks_to_flat(chunks, buffer.layout, group, flat)
    for key, index in entries:
        if index in chunks:
            state[key][name] = buffer.local_view(flat, index)
