"""What the prefetch order, the collective queue, the bucket plan and the
unit paths read of a unit (``unit.Unit`` imports them). Every member is a
property but ``PathUnit.backward_without_hook``, which only the path writes.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence

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


class PathUnit(BucketedUnit, Protocol):
    """What ``unit_paths.py`` reads of a unit besides what the queue does;
    it writes only ``backward_without_hook``."""

    backward_without_hook: bool

    @property
    def prefetch_order(self) -> PathOrder: ...
    @property
    def backward_started(self) -> Callable[[], None]: ...
