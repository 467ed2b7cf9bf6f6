"""A fresh optimizer's state made directly where torch's state-dict functions would take a zero
step.

``torch.distributed.checkpoint.state_dict`` initialises an optimizer's state
with a zero gradient per parameter (the parameters' size), ``lr`` 0 and one
``step()``. The first ``fully_shard`` replaces that function: for torch's
AdamW, Adam and SGD over managed parameters it makes the same state without
the step (``step`` 1, as the zero step leaves it) and registers the
optimizer as zero-initialised; anything else goes to torch's function.
"""

from __future__ import annotations

from typing import Callable, Optional

from torch.optim import Optimizer

from .._torch_private import replace_dcp_init_optim_state
from ._fresh_state import make_state, makes_state_directly
from ._optim import note_zero_initialisation

_original: list[Optional[Callable[[Optimizer], None]]] = []
"""torch's ``_init_optim_state`` once replaced (``[None]``: this torch has none)."""


def install() -> None:
    if not _original:
        _original.append(replace_dcp_init_optim_state(init_optim_state))


def init_optim_state(optim: Optimizer) -> None:
    """torch's ``_init_optim_state``, without the step where it can."""
    params = [p for group in optim.param_groups for p in group["params"]]
    if optim.state or any(p.grad is not None for p in params):
        return  # initialised already (torch's returns here too)
    if not makes_state_directly(optim, params):
        original = _original[0] if _original else None
        if original is not None:
            original(optim)
        return
    make_state(optim, zero_step=True)
    note_zero_initialisation(optim)
