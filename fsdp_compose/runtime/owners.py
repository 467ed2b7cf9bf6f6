"""Which unit manages a given original parameter.

A registry from parameter to :class:`Unit`, shared by the public API
(``param_info``, overlap checks) and the checkpoint conversions, which meet
parameters through optimizers and state dicts rather than through modules.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch

from ..buffers.flat_buffer import FlatBuffer
from .unit import Unit

# id(original parameter) -> the unit that manages it. Weak in the unit (a
# dropped model releases its entries) and not a weak reference to the
# parameter, which would stop torch.utils.swap_tensors (module.to() with
# swap_module_params_on_conversion). The unit holds the parameter, so while
# an entry lives its id cannot be reused.
_OWNERS: "weakref.WeakValueDictionary[int, Unit]" = weakref.WeakValueDictionary()


class Owner(NamedTuple):
    """Where a managed parameter lives: its unit, flat buffer, and index in
    the buffer's records."""

    unit: Unit
    buffer: FlatBuffer
    index: int  # type: ignore[assignment]  # shadows tuple.index, a name callers use


def record_owners(unit: Unit) -> None:
    """Record ``unit`` as the manager of every parameter in its buffers."""
    for buffer in unit.buffers:
        for record in buffer.records:
            _OWNERS[id(record.param)] = unit


def owner_of(param: torch.Tensor) -> Optional[Owner]:
    """The unit, buffer and index managing ``param`` (``None``: not managed)."""
    unit = _OWNERS.get(id(param))
    located = None if unit is None else unit.locate(param)
    return None if located is None else Owner(unit, *located)


def live_units() -> list[Unit]:
    """Every unit that manages a parameter and is still alive (each once)."""
    return list({id(unit): unit for unit in _OWNERS.values()}.values())


def any_owner() -> bool:
    """Whether any live unit manages a parameter (cheap: no iteration)."""
    return len(_OWNERS) > 0
