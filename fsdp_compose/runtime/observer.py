"""The seam between the runtime and the checks that watch its collectives.

The collective queue and the end of backward tell a :class:`CollectiveObserver`
about every data collective *before* issuing it, and let it add bytes to
the end-of-backward flags all-reduce. The runtime only knows this
interface; ``checks/divergence.py`` implements it, and ``fully_shard``
(``setup/units.py``) hands the implementation in, so the runtime never imports
the checks (dependencies point one way, see ``docs/design.md``).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from ..buffers.flat_buffer import FlatBuffer
from ..comm.groups import ShardGroup
from .model_settings import ModelSettings
from .training_state import TrainingState


class ObservedUnit(Protocol):
    """What an observer may read of a unit (``unit.Unit``)."""

    name: str
    group: ShardGroup
    buffers: list[FlatBuffer]


class CollectiveObserver:
    """Sees the collectives of one model. This base class observes nothing
    (used when no check is installed); every method is called on every rank
    in the same order when the ranks behave alike.

    Invariant: the runtime calls ``before_*`` right before the collective
    it names, and never skips one it issues.
    """

    def bind(self, units: Sequence[ObservedUnit], settings: ModelSettings) -> None:
        """The root's lazy init: these are the model's units, in the root's
        state-list order (the same on every rank), and its settings (an
        observer reads ``check_rank_divergence`` there)."""

    def start_iteration(self) -> None:
        """The root's pre-forward of a new iteration."""

    def before_all_gather(self, buffer: FlatBuffer, issuer_state: TrainingState) -> None:
        """``buffer``'s all-gather is about to be issued by the pre-forward
        (``issuer_state`` FORWARD) or pre-backward of a unit (another unit's
        buffer: a prefetch)."""

    def before_reduce_scatter(self, buffer: FlatBuffer) -> None:
        """``buffer``'s reduce-scatter is about to be issued."""

    def after_root_forward(self, order: Sequence[ObservedUnit]) -> None:
        """The root's forward ended; ``order`` is this iteration's forward order."""

    def before_publish(self) -> None:
        """End of the last backward, before the used-flags all-reduce."""

    def will_verify(self) -> bool:
        """Whether the next iteration verifies every collective across
        ranks before issuing it (the runtime then keeps it unbucketed, so a
        divergence is named by the unit whose collective differs)."""
        return False

    def payload(self, group: ShardGroup) -> list[int]:
        """Bytes (0-255) to append to ``group``'s used flags before their
        MAX all-reduce."""
        return []

    def check(self, group: ShardGroup, reduced: Sequence[int]) -> None:
        """After that all-reduce: the reduced values of :meth:`payload`'s bytes."""
