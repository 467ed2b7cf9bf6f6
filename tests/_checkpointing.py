"""Save after two steps, resume a differently initialised model through
torch.distributed.checkpoint, then train both two more steps (shared by the
HSDP and tensor-parallel checkpoint tests)."""

from __future__ import annotations

from typing import Callable

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def resume_through_dcp(build: Callable, step: Callable, root: str):
    """``build(seed) -> (model, optim)``, ``step(model, optim, i)``. Returns
    the trained model, the resumed one and the saved optimizer state dict."""
    model, optim = build(0)
    for i in range(2):
        step(model, optim, i)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root)
    fresh, fresh_optim = build(5)
    step(fresh, fresh_optim, 0)  # give it optimizer state to overwrite
    msd2, osd2 = get_state_dict(fresh, fresh_optim)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=root)
    set_state_dict(fresh, fresh_optim, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    for i in range(2, 4):
        step(model, optim, i)
        step(fresh, fresh_optim, i)
    return model, fresh, osd
