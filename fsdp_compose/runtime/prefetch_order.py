"""Which units to all-gather ahead, by the order units ran forward."""

from __future__ import annotations

from typing import Generic, Optional, Sequence, TypeVar, cast

from .model_settings import ModelSettings
from .protocols import OrderedUnit


U = TypeVar("U", bound=OrderedUnit)
"""``unit.Unit``, which imports this module."""


class PrefetchOrder(Generic[U]):

    __slots__ = ('backward_plan', 'forward_order', 'settings', 'previous_forward_order', 'ran',
                 '_previous_positions', '__dict__', '__weakref__')

    def __init__(self, settings: ModelSettings) -> None:
        self.settings: ModelSettings = settings
        """``prefetch_policy``: whether to prefetch by the recorded order."""
        self.forward_order: list[U] = []
        """Units in the order their forward started this iteration."""
        self.previous_forward_order: list[U] = []
        """The previous iteration's (forward prefetch follows it)."""
        self.ran: dict[int, int] = {}
        """id(unit) -> index in ``forward_order``: the units that ran."""
        self._previous_positions: dict[int, int] = {}
        self.backward_plan: Optional[dict[int, list[U]]] = None
        """id(unit) -> :meth:`backward_targets`, made when the root's forward ends
        so backward hooks read it without a call; ``None`` once stale."""

    # ---------------------------------------------------------------- order
    def start_iteration(self) -> None:
        """The root's pre-forward."""
        if self.forward_order:
            self.previous_forward_order = self.forward_order
            self._previous_positions = self.ran
        self.forward_order, self.ran, self.backward_plan = [], {}, None

    def discard_iteration(self) -> None:
        """``reset_iter_state``: drop the partial order."""
        self.forward_order, self.ran, self.backward_plan = [], {}, None

    def record_forward(self, unit: U, fetch_ahead: bool = True
                       ) -> Sequence[U]:
        """Record ``unit`` (once per pass); return :meth:`forward_targets` if
        ``fetch_ahead``."""
        ran = self.ran
        if id(unit) not in ran:
            ran[id(unit)] = len(self.forward_order)
            self.forward_order.append(unit)
            self.backward_plan = None  # a forward after the root's: its targets change
        return self.forward_targets(unit) if fetch_ahead else ()

    def forward_targets(self, unit: U,
                        order: Optional[list[U]] = None) -> list[U]:
        """Explicit targets, else the unit after ``unit`` in ``order``
        (default: the previous iteration's)."""
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
        """Explicit targets, else the nearest unit before ``unit`` in
        ``order`` (default: this iteration's) that all-gathers in backward."""
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

    def plan_backward(self) -> None:
        """The root's forward ended: make :attr:`backward_plan`."""
        self.backward_plan = {id(unit): self.backward_targets(unit) for unit in self.forward_order}

    def recorded_order(self) -> list[U]:
        """The running, else the last complete, forward's order."""
        return self.forward_order or self.previous_forward_order

def _after(order: list[U], unit: U) -> list[U]:
    for index, candidate in enumerate(order):
        if candidate is unit:
            return order[index + 1:index + 2]
    return []
