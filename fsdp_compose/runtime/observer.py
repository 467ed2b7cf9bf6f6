"""The seam between the runtime and the checks that watch its collectives:
``checks/divergence.py`` implements :class:`CollectiveObserver` and
``setup/units.py`` hands it in, so the runtime never imports the checks.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch.nn as nn

from ..buffers.flat_buffer import FlatBuffer
from ..comm.groups import ShardGroup
from .model_settings import ModelSettings
from .training_state import TrainingState


class ObservedUnit(Protocol):
    """What an observer may read of a ``unit.Unit``."""

    name: str
    group: ShardGroup
    buffers: list[FlatBuffer]
    modules: tuple[nn.Module, ...]


class CollectiveObserver:
    """Sees the collectives of one model; this base observes nothing. Every
    method is called on every rank in the same order when the ranks behave
    alike.

    Invariant: the runtime calls ``before_*`` right before the collective
    it names, and never skips one it issues ([Note: the life of a
    collective]).
    """

    def bind(self, units: Sequence[ObservedUnit], settings: ModelSettings) -> None:
        """The root's lazy init: the units in state-list order (the same on
        every rank) and the settings (``check_rank_divergence``)."""

    def start_iteration(self) -> None:
        """The root's pre-forward of a new iteration."""

    def before_all_gather(self, buffer: FlatBuffer, issuer_state: TrainingState) -> None:
        """``issuer_state``: of the unit whose pre-forward or pre-backward
        issues it (another unit's buffer: a prefetch)."""

    def before_reduce_scatter(self, buffer: FlatBuffer) -> None:
        """``buffer``'s reduce-scatter is about to be issued."""

    def after_root_forward(self, order: Sequence[ObservedUnit]) -> None:
        """``order``: this iteration's forward order."""

    def before_publish(self) -> None:
        """End of the last backward, before the used-flags all-reduce."""

    def will_verify(self) -> bool:
        """The next iteration verifies every collective before issuing it
        (it then runs unbucketed)."""
        return False

    def payload(self, group: ShardGroup) -> list[int]:
        """Bytes (0-255) appended to ``group``'s used flags (MAX all-reduce)."""
        return []

    def check(self, group: ShardGroup, reduced: Sequence[int]) -> None:
        """The reduced values of :meth:`payload`'s bytes."""
