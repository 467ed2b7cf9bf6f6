"""Where a unit is in the iteration: the one enum every layer above reads.

A leaf module (no imports from the package), so the checks, the
checkpoint conversions and the tools can read a unit's state without
importing the runtime's machinery.
"""

from __future__ import annotations

from enum import Enum, auto


class TrainingState(Enum):
    """Where a unit is in the iteration (``Unit.training_state``)."""

    IDLE = auto()
    """Between iterations: sharded (unless the user called ``unshard()`` or
    ``reshard_after_backward=False`` kept it unsharded)."""
    FORWARD = auto()
    """Inside the forward of one of its modules: unsharded."""
    PRE_BACKWARD = auto()
    """Its outputs' gradients have arrived: unsharded for backward, gradients
    not yet reduced."""
    POST_BACKWARD = auto()
    """Its gradients were reduced (or it kept them for accumulation without
    sync) in this backward."""
