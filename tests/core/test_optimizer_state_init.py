"""A fresh optimizer's state for ``torch.distributed.checkpoint.state_dict``
made directly (``checkpoint/_init_state.py``) is exactly the state torch's
zero step makes, without the step.

World size 3, uneven shapes; under ``"owned"`` a rank holds none of some
matrices (its state there comes from the initialisation alone). Each case
builds the same model twice: one optimizer initialised by torch's own
``_init_optim_state`` (kept by the replacement), one by the function torch
now calls; the state (keys, values, dtypes, devices, strides), the
parameters, the ``.grad`` left behind and the zero-initialisation mark must
agree, and no optimizer step may run for the second.
"""

from __future__ import annotations

import pytest
import torch

from tests._models import TinyLM
from tests.harness import run_distributed

WORLD = 3
CASES = {
    "adamw-amsgrad-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, foreach=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd-plain": lambda ps: torch.optim.SGD(ps, lr=0.1),
}


def _model(placement):
    from fsdp_compose import fully_shard
    torch.manual_seed(1234)
    model = TinyLM(n_blocks=3)
    model.blocks[2].fc1.weight.requires_grad_(False)  # frozen: no state, as torch's step gives
    for block in model.blocks:
        fully_shard(block, shard_placement_fn=(lambda p: placement if p.ndim == 2 else None))
    fully_shard(model)
    return model


def _init_both(case: str, placement) -> dict:
    import torch.distributed.checkpoint.state_dict as dcp_state_dict
    from fsdp_compose.checkpoint import _init_state, _optim
    out = {"differences": []}
    built = []
    models = [_model(placement), _model(placement)]  # the first fully_shard installs
    for model, init in zip(models, (_init_state._original[0], dcp_state_dict._init_optim_state)):
        optim = CASES[case](list(model.parameters()))
        steps = []
        optim.register_step_pre_hook(lambda *_: steps.append(1))
        init(optim)
        built.append((model, optim, len(steps), optim in _optim._ZERO_STEPPED))
    (model_a, optim_a, steps_a, zero_a), (model_b, optim_b, steps_b, zero_b) = built
    out["steps"], out["zero_marks"] = (steps_a, steps_b), (zero_a, zero_b)
    params_b = dict(model_b.named_parameters())
    for name, a in model_a.named_parameters():
        b = params_b[name]
        if not torch.equal(a.detach(), b.detach()) or (a.grad is None) != (b.grad is None):
            out["differences"].append(f"{name}: value or .grad")
        sa, sb = optim_a.state.get(a, {}), optim_b.state.get(b, {})
        if list(sa) != list(sb):
            out["differences"].append(f"{name}: keys {list(sa)} != {list(sb)}")
            continue
        for key, va in sa.items():
            vb = sb[key]
            if (va.dtype, va.device, va.shape, va.stride()) != \
                    (vb.dtype, vb.device, vb.shape, vb.stride()) or not torch.equal(va, vb):
                out["differences"].append(f"{name}.{key}: {va} != {vb}")
    return out


@pytest.mark.parametrize("placement", [None, "owned"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_state_is_torchs_zero_step_state_without_the_step(case, placement):
    for rank, out in enumerate(run_distributed(WORLD, _init_both, case, placement)):
        assert not out["differences"], f"rank {rank}: {out['differences']}"
        assert out["steps"] == (1, 0), f"rank {rank}: steps taken (torch, direct) {out['steps']}"
        assert out["zero_marks"] == (True, True), f"rank {rank}: {out['zero_marks']}"
