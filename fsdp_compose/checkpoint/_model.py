"""``state_dict()`` / ``load_state_dict()`` of annotated modules in torch FSDP2's checkpoint
layout: every managed parameter is a ``DTensor`` of its original shape placed as FSDP2 places
it; loading also takes other ``DTensor`` layouts and full tensors, written into the shards in
place. The first hook reached converts the unit's parameters (lazily where the layout allows:
[Note: lazy checkpoint values]).
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any, NamedTuple, Optional

import torch
import torch.nn as nn

from ..buffers.flat_buffer import FlatBuffer
from ..buffers.records import ParamRecord
from ..comm.rendezvous import arrive
from ..runtime.training_state import TrainingState
from ..runtime.unit import Unit
from ._exchange import (checkpoint_shape, chunks_to_flat, flat_to_chunks, loadable, record_value,
                        shard_dim, shard_dim_local, shard_dim_value)
from ._chunks import chunk_shape
from ._exchange import checkpoint_placements
from ._lazy import SAVE_ADVICE, in_place, is_lazy, lazy_value
from ._pieces import ShardPieces, flat_values_requested, has_pieces


_STATE_DICT_FIX = (
    "The values of a fully_shard model are spread over the ranks: call state_dict() / "
    "load_state_dict() on every rank. " + SAVE_ADVICE)


_MET: list[tuple["UnitStateDictHooks", nn.Module, Any]] = []
"""The ``state_dict()`` call in progress whose first unit met the other
ranks ([Note: call rendezvous]); later units of the same group do not."""


def _met_in_this_call(group: Any) -> bool:
    if not _MET:
        return False
    hooks, module, met_group = _MET[0]
    if hooks._stash is None or hooks._stash.owner is not module:
        _MET.clear()  # left by a call that raised
        return False
    return met_group is group


class _Stash(NamedTuple):
    owner: nn.Module
    values: dict[int, torch.Tensor]


class UnitStateDictHooks:
    """The state-dict hooks of one unit on its managed modules, and on another
    unit's module borrowing one of its parameters."""

    def __init__(self, unit: Unit, borrowed_at: Optional[tuple[nn.Module, str]] = None) -> None:
        self.unit: Unit = unit
        self._record_at: dict[tuple[int, str], ParamRecord] = {
            (id(module), name): record
            for buffer in unit.buffers for record in buffer.records
            for module, name in record.slots
            if borrowed_at is None or (module is borrowed_at[0] and name == borrowed_at[1])}
        self._stash: Optional[_Stash] = None
        modules = unit.managed_modules if borrowed_at is None else (borrowed_at[0],)
        for module in modules:
            # partial, not bound methods: torch tags public hooks with an attribute
            module.register_state_dict_pre_hook(partial(UnitStateDictHooks._before_state_dict, self))
            module.register_state_dict_post_hook(partial(UnitStateDictHooks._after_state_dict, self))
            module.register_load_state_dict_pre_hook(partial(UnitStateDictHooks._before_load, self))
        if borrowed_at is None:
            for tie in unit.ties:
                if tie.borrower is unit:
                    UnitStateDictHooks(tie.owner, (tie.module, tie.attr))

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self._stash is not None and self._stash.owner is not module:
            return  # an enclosing module's state_dict() converted this unit already
        group = self.unit.group.process_group
        if not _met_in_this_call(group):
            arrive(group, f"state_dict() (converting unit {self.unit.name})", _STATE_DICT_FIX)
            _MET[:] = [(self, module, group)]
        below = self._records_below(module)
        skip_frozen = _torch_drops_frozen_params()
        flat = flat_values_requested()
        if flat:
            self._make_loadable()
        values: dict[int, Any] = {}
        for buffer in self.unit.buffers:
            group = buffer.group
            selected = [i for i, r in enumerate(buffer.records)
                        if id(r.param) in below and not (skip_frozen and not r.param.requires_grad)]
            if flat:
                for index in selected:
                    if has_pieces(buffer, index):
                        values[id(buffer.records[index].param)] = ShardPieces.of(
                            buffer, index, buffer.local_view(buffer.sharded.detach(), index),
                            lead=group.rank == 0)
                selected = [i for i in selected if not has_pieces(buffer, i)]
            else:
                for index in selected:
                    if is_lazy(buffer, index):
                        values[id(buffer.records[index].param)] = _lazy_param(buffer, index)
                selected = [i for i in selected if not is_lazy(buffer, i)]
            if not selected:
                continue  # the same on every rank
            for index in selected:
                record = buffer.records[index]
                if shard_dim(record) is not None:
                    values[id(record.param)] = shard_dim_value(
                        buffer.local_view(buffer.sharded.detach(), index), record, group)
            selected = [i for i in selected if shard_dim(buffer.records[i]) is None]
            if not selected:
                continue
            chunks = flat_to_chunks(buffer.sharded.detach(), buffer.layout, group, selected)
            for index, chunk in chunks.items():
                record = buffer.records[index]
                values[id(record.param)] = record_value(chunk, record, group)
        self._stash = _Stash(module, values)

    def _after_state_dict(self, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                          local_metadata: dict) -> None:
        stash = self._stash
        if stash is None:
            raise AssertionError(f"state_dict post-hook of {self.unit.name} ran without its pre-hook")
        for name in module._parameters:
            record = self._record_at.get((id(module), name))
            key = prefix + name
            if record is None or key not in state_dict:
                continue
            value = stash.values.get(id(record.param))
            if value is not None:
                state_dict[key] = value
        if stash.owner is module:
            self._stash = None
        if _MET and _MET[0][0] is self and _MET[0][1] is module:
            _MET.clear()

    def _records_below(self, module: nn.Module) -> set[int]:
        return {id(record.param) for sub in module.modules() for name in sub._parameters
                if (record := self._record_at.get((id(sub), name))) is not None}

    def _before_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                     local_metadata: dict, strict: bool, missing_keys: list[str],
                     unexpected_keys: list[str], error_msgs: list[str]) -> None:
        keys = self._keys_below(module, prefix)
        if not any(key in state_dict and state_dict[key] is not record.param
                   for key, record in keys):
            return  # an enclosing module's hook did it
        arrive(self.unit.group.process_group,
               f"load_state_dict() (converting unit {self.unit.name})", _STATE_DICT_FIX)
        self._make_loadable()
        by_param: dict[int, tuple[ParamRecord, torch.Tensor]] = {}
        for key, record in keys:
            value = state_dict.get(key)
            if value is None or value is record.param:
                continue
            if in_place(value, self._sharded_of(record)):
                state_dict[key] = record.param
                continue
            if isinstance(value, ShardPieces):
                if value.local is None or value.local.untyped_storage().data_ptr() != \
                        record.param.untyped_storage().data_ptr():
                    error_msgs.append(f"{key}: a flat_state_dict() value of another model; "
                                      "load flat_state_dict values into the model they came from")
                state_dict[key] = record.param
                continue
            expected = checkpoint_shape(record)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(expected):
                shape = value.shape if isinstance(value, torch.Tensor) else type(value)
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {shape} from "
                    f"checkpoint, the shape in current model is {expected}.")
            else:
                by_param.setdefault(id(record.param), (record, value))
            state_dict[key] = record.param  # torch's own copy becomes a no-op
        for buffer in self.unit.buffers:
            values = {i: by_param[id(r.param)][1] for i, r in enumerate(buffer.records)
                      if id(r.param) in by_param}
            if values:
                _load_into(buffer, values)

    def _sharded_of(self, record: ParamRecord) -> torch.Tensor:
        return next(b.sharded for b in self.unit.buffers
                    if any(r is record for r in b.records))

    def _keys_below(self, module: nn.Module, prefix: str) -> list[tuple[str, ParamRecord]]:
        keys = []
        for name, sub in module.named_modules(prefix=prefix.rstrip("."), remove_duplicate=False):
            for attr in sub._parameters:
                record = self._record_at.get((id(sub), attr))
                if record is not None:
                    keys.append((f"{name}.{attr}" if name else attr, record))
        return keys

    def _make_loadable(self) -> None:
        unit = self.unit
        if unit.training_state is not TrainingState.IDLE:
            raise RuntimeError(
                f"load_state_dict() reached {unit.name} during its {unit.training_state.name.lower()}; "
                "load checkpoints between iterations (after optimizer.step(), before forward).")
        unit.reshard()  # kept unsharded by unshard() or reshard_after_backward=False


def _lazy_param(buffer: FlatBuffer, index: int) -> torch.Tensor:
    record, group, source = buffer.records[index], buffer.group, buffer.sharded
    pieces = ShardPieces.of(buffer, index, buffer.local_view(source.detach(), index),
                            lead=group.rank == 0)
    return lazy_value(record.shape, chunk_shape(record.shape, group.world_size, group.rank),
                      pieces, source,
                      lambda: flat_to_chunks(source.detach(), buffer.layout, group, [index])[index],
                      group, checkpoint_placements(group), record.fqn, source.device)


def _load_into(buffer: FlatBuffer, values: dict[int, torch.Tensor]) -> None:
    """Write checkpoint values into this rank's slices (full tensors sliced
    locally, ``DTensor`` by one all-to-all). Pre-condition: resharded."""
    group, slices = buffer.group, buffer.local_slices()
    chunks: dict[int, torch.Tensor] = {}
    full: dict[int, torch.Tensor] = {}
    for index, value in values.items():
        if shard_dim(buffer.records[index]) is not None:
            with torch.no_grad():
                buffer.local_view(buffer.sharded, index).copy_(
                    shard_dim_local(value, buffer.records[index], group))
            continue
        chunk, whole = loadable(value, buffer.records[index], group)
        if chunk is not None:
            chunks[index] = chunk
        else:
            full[index] = whole
    with torch.no_grad():
        if chunks:
            chunks_to_flat(chunks, buffer.layout, group, buffer.sharded)
        for index, value in full.items():
            s = slices[index]
            flat = value.detach().reshape(-1)[s.param_start:s.param_start + s.length]
            buffer.sharded.narrow(0, s.shard_start, s.length).copy_(flat)


def _torch_drops_frozen_params() -> bool:
    """Inside torch's ``get_model_state_dict(ignore_frozen_params=True)``:
    frozen parameters are dropped, so not converted. Read from torch's frame."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_get_model_state_dict" and \
                frame.f_globals.get("__name__") == "torch.distributed.checkpoint.state_dict":
            return bool(getattr(frame.f_locals.get("info"), "ignore_frozen_params", False))
        frame = frame.f_back
    return False
