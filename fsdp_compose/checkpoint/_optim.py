"""Optimizer state of managed parameters in torch FSDP2's checkpoint layout.

An optimizer over sharded parameters keeps per-element state (``exp_avg``,
``exp_avg_sq``, ``momentum_buffer``) as 1-D slices shaped like the
parameters. Its ``state_dict()`` gets a post-hook that turns each such
tensor into a ``DTensor`` of the parameter's original shape placed
``Shard(0)`` (the same conversion as the parameter's own), and its
``load_state_dict()`` a pre-hook that turns such values (or full tensors)
back into slices. Other state (``step``) and the param groups pass through.
torch's ``torch.distributed.checkpoint.state_dict`` functions then work
unchanged: they map indices to FQNs around these hooks.

The hooks are attached to an optimizer by :func:`register_optimizer`, which
a global optimizer step pre-hook calls at every optimizer's first step (and
torch's ``get/set_optimizer_state_dict`` step a fresh optimizer first). Call
it yourself to ``optimizer.load_state_dict()`` into an optimizer that never
stepped.
"""

from __future__ import annotations

import bisect
import weakref
from itertools import chain
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..buffers.flat_buffer import FlatBuffer
from ..comm.rendezvous import arrive
from ..runtime.owners import owner_of
from ._exchange import Reader, checkpoint_shape, chunks_to_flat, flat_to_chunks, loadable, record_value

_SEEN: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
"""Optimizers the step pre-hook has looked at (hooks attached if needed)."""
_ATTACHED: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()


def register_optimizer(optimizer: Optimizer) -> None:
    """Make ``optimizer.state_dict()`` / ``load_state_dict()`` speak the
    checkpoint layout for the parameters ``fully_shard`` manages.
    Idempotent; a no-op for an optimizer with none of them."""
    _SEEN.add(optimizer)
    if optimizer in _ATTACHED or not any(owner_of(p) is not None for p in _params(optimizer)):
        return
    optimizer.register_state_dict_post_hook(_to_checkpoint_layout)
    optimizer.register_load_state_dict_pre_hook(_from_checkpoint_layout)
    _ATTACHED.add(optimizer)


def _on_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer not in _SEEN:  # one set lookup per step after the first
        register_optimizer(optimizer)


_STEP_HOOK = register_optimizer_step_pre_hook(_on_step)


def _params(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _is_per_element(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
        and value.dim() == 1 and value.shape == param.shape


class _BufferEntries:
    """Managed parameters of one flat buffer found in an optimizer:
    ``(state key, index in the buffer)`` pairs, in optimizer order."""

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


# ------------------------------------------------------------------- save
_OPTIM_FIX = ("Sharded optimizer state is spread over the ranks: call it on every rank (to "
              "write a file from rank 0 only, take it on every rank and save it under "
              "`if rank == 0:`; or use CheckpointStore).")


def _to_checkpoint_layout(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    arrive(None, "optimizer.state_dict()", _OPTIM_FIX)
    params = dict(enumerate(_params(optimizer)))
    state = state_dict["state"]
    plan = []  # (buffer, state name, [(state key, buffer index)])
    for group in _by_buffer(params):
        names = sorted({name for key, _ in group.entries
                        for name, value in state.get(key, {}).items()
                        if _is_per_element(value, params[key])})
        for name in names:
            plan.append((group.buffer, name, [(key, index) for key, index in group.entries
                                              if name in state.get(key, {})]))
    _check_same_on_every_rank(plan)
    for buffer, name, entries in plan:
        _refuse_scalar_params(buffer, name, entries)
        first = state[entries[0][0]][name]
        chunks = flat_to_chunks(_reader(buffer, name, entries, state), buffer.layout,
                                buffer.group, [i for _, i in entries], dtype=first.dtype,
                                home=first.device)
        for key, index in entries:
            if state[key] is optimizer.state.get(params[key]):
                state[key] = dict(state[key])  # never modify the optimizer's own state
            value = record_value(chunks[index], buffer.records[index], buffer.group)
            state[key][name] = value


def _reader(buffer: FlatBuffer, name: str, entries: list[tuple[Any, int]],
            state: dict[Any, dict[str, Any]]) -> Reader:
    """Reads shard intervals of state ``name`` straight from each
    parameter's own state tensor (no flat copy is assembled)."""
    slices = buffer.local_slices()
    owned = sorted((slices[index].shard_start, slices[index].length, state[key][name])
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


def _check_same_on_every_rank(plan: list) -> None:
    """The conversions are collective: every rank must convert the same
    states of the same parameters, or they would wait for each other
    forever. One object all-gather checks it and raises on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    summary = [(buffer.records[0].fqn, name, [i for _, i in entries])
               for buffer, name, entries in plan]
    every: list[Optional[list]] = [None] * dist.get_world_size()
    dist.all_gather_object(every, summary)
    if any(other != summary for other in every):
        differing = next(r for r, other in enumerate(every) if other != summary)
        raise RuntimeError(
            "optimizer.state_dict(): ranks hold per-element optimizer state for different "
            f"parameters (this rank: {_describe(summary)}; rank {differing}: "
            f"{_describe(every[differing])}). Step the optimizer on every rank (e.g. with "
            "gradients of zero) before saving, so that every rank has the same state.")


def _describe(summary: Optional[list]) -> str:
    return ", ".join(f"{name} of {len(indices)} params in the buffer of '{fqn}'"
                     for fqn, name, indices in summary or []) or "none"


# ------------------------------------------------------------------- load
def _from_checkpoint_layout(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    arrive(None, "optimizer.load_state_dict()", _OPTIM_FIX)
    saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = dict(zip(saved_ids, _params(optimizer)))
    state = {key: dict(value) if isinstance(value, dict) else value
             for key, value in state_dict["state"].items()}
    for group in _by_buffer({k: p for k, p in params.items() if k in state}):
        buffer = group.buffer
        names = sorted({name for key, _ in group.entries for name, value in state[key].items()
                        if isinstance(value, torch.Tensor) and value.dim() > 0})
        for name in names:
            entries = [(key, index) for key, index in group.entries
                       if isinstance(state[key].get(name), torch.Tensor)]
            _load_state(buffer, name, entries, state)
    return {**state_dict, "state": state}


def _load_state(buffer: FlatBuffer, name: str, entries: list[tuple[Any, int]],
                state: dict[Any, dict[str, Any]]) -> None:
    """Replace ``state[key][name]`` (global shape: ``DTensor`` or full tensor)
    by this rank's 1-D slice for every entry."""
    slices, group = buffer.local_slices(), buffer.group
    chunks: dict[int, torch.Tensor] = {}
    dtype, device = None, None
    for key, index in entries:
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
        state[key][name] = value.detach().reshape(-1)[s.param_start:s.param_start + s.length].clone()
    if not chunks:
        return
    flat = torch.empty(buffer.layout.shard_numel, dtype=dtype, device=device)
    chunks_to_flat(chunks, buffer.layout, group, flat)  # writes every entry's slice
    for key, index in entries:
        if index in chunks:
            s = slices[index]
            state[key][name] = flat.narrow(0, s.shard_start, s.length)  # `flat` is fresh
