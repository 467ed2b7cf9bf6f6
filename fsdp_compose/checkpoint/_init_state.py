"""A fresh optimizer's state made directly where torch's state-dict
functions would take a zero step.

``torch.distributed.checkpoint.state_dict`` (``get_state_dict``,
``get_optimizer_state_dict``, ``set_optimizer_state_dict``, so DCP resumes)
first gives an optimizer without state its state through
``_init_optim_state``: a zero gradient for every parameter that requires
one (the parameters' size in memory), ``lr`` 0, one ``step()``, then
``zero_grad``. The first ``fully_shard`` replaces that function
(:func:`install`) by one that, for torch's AdamW, Adam and SGD over
parameters ``fully_shard`` manages, makes the same state without the step:

* torch's own ``_init_group`` on each group creates what its first step
  creates (``step``'s dtype and device for capturable and fused, ``amsgrad``'s
  ``max_exp_avg_sq``, the fused device check), given a stand-in gradient
  that holds no memory (a zero scalar expanded to the parameter's shape);
* ``step`` is then 1, as the zero step leaves it, and SGD with momentum gets
  the zero ``momentum_buffer`` that step would have cloned from the zero
  gradient;
* the parameters are not touched (the zero step, at ``lr`` 0, leaves them
  as they are), and no step hook runs; what the checkpoint step pre-hook
  does at such a step is done here (the optimizer is registered and marked
  zero-initialised, which ``_optim._drop_zero_step_state`` relies on where
  a rank holds none of the parameters that trained).

Anything else (other optimizer classes, complex parameters, an optimizer
over no managed parameter, state or gradients present) goes to torch's own
function, unchanged.

The state is made by ``_fresh_state.make_state``, which also makes it
without counting a step for a registered optimizer's ``state_dict()``.
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
    """Replace torch's ``_init_optim_state`` (once per process)."""
    if not _original:
        _original.append(replace_dcp_init_optim_state(init_optim_state))


def init_optim_state(optim: Optimizer) -> None:
    """torch's ``_init_optim_state``, without the step where it can (see the module note)."""
    params = [p for group in optim.param_groups for p in group["params"]]
    if optim.state or any(p.grad is not None for p in params):
        return  # torch's function returns here too: initialised already
    if not makes_state_directly(optim, params):
        original = _original[0] if _original else None
        if original is not None:
            original(optim)
        return
    make_state(optim, zero_step=True)
    note_zero_initialisation(optim)
