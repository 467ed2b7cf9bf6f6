"""Which unit manages a given original parameter, for code that meets
parameters through optimizers and state dicts rather than modules.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch

from ..buffers.flat_buffer import FlatBuffer
from .unit import Unit

# id(parameter) -> unit, weak in the unit (a weak key would stop swap_tensors);
# the unit holds the parameter, so a live entry's id is not reused
_OWNERS: "weakref.WeakValueDictionary[int, Unit]" = weakref.WeakValueDictionary()


class Owner(NamedTuple):
    """Where a managed parameter lives (``index``: in the buffer's records)."""

    unit: Unit
    buffer: FlatBuffer
    index: int  # type: ignore[assignment]  # shadows tuple.index, a name callers use


def record_owners(unit: Unit) -> None:
    for buffer in unit.buffers:
        for record in buffer.records:
            _OWNERS[id(record.param)] = unit


# id(original) -> (the original, weakly; its plain replacement): another unit's
# module may still hold a replaced tensor-parallel original (a tied weight)
_REPLACED: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def record_replacement(original: torch.Tensor, replacement: torch.Tensor) -> None:
    _REPLACED[id(original)] = (weakref.ref(original), replacement)
    weakref.finalize(original, _REPLACED.pop, id(original), None)


def replacement_of(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The plain parameter that replaced tensor-parallel ``param``, or ``None``."""
    entry = _REPLACED.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def owner_of(param: torch.Tensor) -> Optional[Owner]:
    unit = _OWNERS.get(id(param))
    located = None if unit is None else unit.locate(param)
    return None if located is None else Owner(unit, *located)


def live_units() -> list[Unit]:
    """Each live unit once."""
    return list({id(unit): unit for unit in _OWNERS.values()}.values())


def any_owner() -> bool:
    """Cheap: no iteration."""
    return len(_OWNERS) > 0
