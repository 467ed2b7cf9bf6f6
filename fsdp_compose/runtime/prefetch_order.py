"""Prefetch order: which units to all-gather ahead, by the order in which
units ran forward.

One :class:`PrefetchOrder` per model, shared by its units: it records the
order units run forward in and names the prefetch targets of each
pre-forward and pre-backward; the collectives are ``collective_queue.py``'s.
"""

from __future__ import annotations

from typing import Generic, Optional, Sequence, TypeVar, cast

from .model_settings import ModelSettings
from .unit_protocols import OrderedUnit


U = TypeVar("U", bound=OrderedUnit)
"""The units of one model (``unit.Unit``, which imports this module)."""


class PrefetchOrder(Generic[U]):
    """Forward order and prefetch targets for one model."""

    __slots__ = ('forward_order', 'settings', 'previous_forward_order', 'ran',
                 '_previous_positions', '__dict__', '__weakref__')

    def __init__(self, settings: ModelSettings) -> None:
        self.settings: ModelSettings = settings
        """The model's settings: ``prefetch_policy`` says whether forward
        and backward prefetch by the recorded order."""
        self.forward_order: list[U] = []
        """Units in the order their forward started in this iteration."""
        self.previous_forward_order: list[U] = []
        """The same for the previous iteration (used by forward prefetch)."""
        self.ran: dict[int, int] = {}
        """id(unit) -> its index in ``forward_order``: the ids of the units
        whose forward ran in this pass (prefetch looks units up once per
        unit: no scan of the order)."""
        self._previous_positions: dict[int, int] = {}
        """The same for ``previous_forward_order``."""

    # ---------------------------------------------------------------- order
    def start_iteration(self) -> None:
        """Called at the root's pre-forward: a new forward order begins."""
        if self.forward_order:
            self.previous_forward_order = self.forward_order
            self._previous_positions = self.ran
        self.forward_order, self.ran = [], {}

    def discard_iteration(self) -> None:
        """Forget an iteration that raised (``reset_iter_state``): its partial
        forward order (forward prefetch keeps following the last complete
        one)."""
        self.forward_order, self.ran = [], {}

    def record_forward(self, unit: U, fetch_ahead: bool = True
                       ) -> Sequence[U]:
        """``unit``'s forward starts: record it in the order (the first time
        in this pass) and return :meth:`forward_targets` (one call: once per
        unit and step); none where not ``fetch_ahead`` (nothing of the
        model all-gathers)."""
        ran = self.ran
        if id(unit) not in ran:
            ran[id(unit)] = len(self.forward_order)
            self.forward_order.append(unit)
        return self.forward_targets(unit) if fetch_ahead else ()

    def forward_targets(self, unit: U,
                        order: Optional[list[U]] = None) -> list[U]:
        """The units to all-gather before ``unit``'s forward: its explicit
        targets, else the unit after it in ``order`` (default: the previous
        iteration's forward order)."""
        if unit.settings.forward_prefetch is not None:
            return cast(list[U], list(unit.settings.forward_prefetch))  # units of this model
        if not self.settings.prefetch_policy.forward:
            return []
        if order is not None:
            return _after(order, unit)
        position = self._previous_positions.get(id(unit))
        return self.previous_forward_order[position + 1:position + 2] if position is not None else []

    def backward_targets(self, unit: U,
                         order: Optional[list[U]] = None) -> list[U]:
        """The units to all-gather when ``unit``'s backward starts: its
        explicit targets, else the unit before it in ``order`` (default:
        this iteration's forward order) that all-gathers in backward."""
        if unit.settings.backward_prefetch is not None:
            return cast(list[U], list(unit.settings.backward_prefetch))  # units of this model
        if not self.settings.prefetch_policy.backward:
            return []
        if order is None:
            order, position = self.forward_order, self.ran.get(id(unit))
        else:
            position = next((i for i, u in enumerate(order) if u is unit), None)
        if position is None:
            return []
        for earlier in range(position - 1, -1, -1):  # the nearest that all-gathers in backward
            if order[earlier].settings.unshard_in_backward:
                return [order[earlier]]
        return []

    def recorded_order(self) -> list[U]:
        """The running (else the last complete) forward's order; empty
        before the first forward. What the next iteration prefetches by
        (``tools/describe.py`` reports it with the two methods above)."""
        return self.forward_order or self.previous_forward_order

def _after(order: list[U], unit: U) -> list[U]:
    """The unit right after ``unit`` in ``order`` (empty if none)."""
    for index, candidate in enumerate(order):
        if candidate is unit:
            return order[index + 1:index + 2]
    return []
