"""The interfaces between the runtime's parts, and the seam to the checks:
``checks/divergence.py`` implements :class:`CollectiveObserver` and
``setup/units.py`` hands it in, so the runtime never imports the checks.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence

import torch.nn as nn

from ..buffers.flat_buffer import FlatBuffer
from ..buffers.flat_grad import ReduceOptions
from ..comm.groups import ShardGroup
from .training_state import TrainingState


class OrderSettings(Protocol):
    """Of ``UnitSettings``."""

    @property
    def forward_prefetch(self) -> Optional[Sequence[OrderedUnit]]: ...
    @property
    def backward_prefetch(self) -> Optional[Sequence[OrderedUnit]]: ...
    @property
    def unshard_in_backward(self) -> bool: ...


class OrderedUnit(Protocol):
    """The prefetch order records units by identity."""

    @property
    def settings(self) -> OrderSettings: ...


class BucketSettings(OrderSettings, Protocol):
    """What ``buckets._key`` reads."""

    @property
    def post_forward_group(self) -> Optional[ShardGroup]: ...
    @property
    def reduce_scatter_unused_params(self) -> bool: ...
    @property
    def offload_policy(self) -> Optional[object]: ...
    @property
    def reduce_options(self) -> ReduceOptions: ...
    @property
    def requires_gradient_sync(self) -> bool: ...


class BucketedUnit(Protocol):

    @property
    def name(self) -> str: ...
    @property
    def buffers(self) -> Sequence[FlatBuffer]: ...
    @property
    def training_state(self) -> TrainingState: ...
    @property
    def backward_possible(self) -> bool: ...
    @property
    def settings(self) -> BucketSettings: ...
    @property
    def is_root(self) -> bool: ...
    @property
    def trainable_buffers(self) -> Sequence[FlatBuffer]: ...
    @property
    def resolved_reshard_after_forward(self) -> bool: ...


class PathOrder(Protocol):
    """Of ``prefetch_order.PrefetchOrder``."""

    @property
    def ran(self) -> dict[int, int]: ...
    def record_forward(self, unit: Any, fetch_ahead: bool = True) -> Sequence[Any]: ...
    def backward_targets(self, unit: Any) -> Sequence[Any]: ...
    @property
    def backward_plan(self) -> Optional[dict[int, Any]]: ...
    def plan_backward(self) -> None: ...


class PathUnit(BucketedUnit, Protocol):
    """What ``unit_paths.py`` reads of a unit; it writes only
    ``backward_without_hook``."""

    backward_without_hook: bool

    @property
    def prefetch_order(self) -> PathOrder: ...
    @property
    def backward_started(self) -> Callable[[], None]: ...


class ObservedSettings(Protocol):
    """Of ``model_settings.ModelSettings``."""

    @property
    def check_rank_divergence(self) -> Optional[bool]: ...


class ObservedUnit(Protocol):
    """What an observer may read of a ``unit.Unit``."""

    name: str
    group: ShardGroup
    buffers: list[FlatBuffer]
    modules: tuple[nn.Module, ...]


class CollectiveObserver:
    """Sees one model's collectives; this base observes nothing. Called on every
    rank in the same order when the ranks behave alike, ``before_*`` right
    before each collective issued ([Note: the life of a collective])."""

    def bind(self, units: Sequence[ObservedUnit], settings: ObservedSettings) -> None:
        """The root's lazy init: the units, in the same order on every rank, and
        the settings."""

    def start_iteration(self) -> None:
        """The root's pre-forward of a new iteration."""

    def before_all_gather(self, buffer: FlatBuffer, issuer_state: TrainingState) -> None:
        """``issuer_state``: of the unit whose hook issues it."""

    def before_reduce_scatter(self, buffer: FlatBuffer) -> None:
        """``buffer``'s reduce-scatter is about to be issued."""

    def after_root_forward(self, order: Sequence[ObservedUnit]) -> None:
        """``order``: this iteration's forward order."""

    def before_publish(self) -> None:
        """End of the last backward, before the used-flags all-reduce."""

    def will_verify(self) -> bool:
        """The next iteration verifies every collective (and runs unbucketed)."""
        return False

    def payload(self, group: ShardGroup) -> list[int]:
        """Bytes (0-255) appended to ``group``'s used flags (MAX all-reduce)."""
        return []

    def check(self, group: ShardGroup, reduced: Sequence[int]) -> None:
        """The reduced values of :meth:`payload`'s bytes."""
