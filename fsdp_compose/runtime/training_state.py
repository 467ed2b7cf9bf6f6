"""Where a unit is in the iteration. A leaf module (no package imports),
so the checks, checkpoints and tools read it without the runtime.
"""

from __future__ import annotations

from enum import Enum, auto


class TrainingState(Enum):
    """``Unit.training_state``."""

    IDLE = auto()
    """Between iterations: sharded (unless the user called ``unshard()`` or
    ``reshard_after_backward=False`` kept it unsharded)."""
    FORWARD = auto()
    """Inside the forward of one of its modules: unsharded."""
    PRE_BACKWARD = auto()
    """Its outputs' gradients arrived: unsharded, gradients not reduced yet."""
    POST_BACKWARD = auto()
    """Its gradients were reduced (or kept, without sync) in this backward."""
