"""``fsdp_compose.flat_step``: the optimizer steps each buffer's shard as a
few flat tensors, bitwise equal to torch's own per-parameter step.

Every rank trains two copies of the same sharded model on the same batches
(world size 3, uneven shapes: padding, and ranks holding none of a small
parameter), one optimizer stepped by torch, one with ``flat_step``; after
every step the parameters and the optimizer state must be bitwise equal.

1. AdamW/Adam/SGD, foreach and for-loop, weight decay, per-group
   hyperparameters, ``maximize``, ``amsgrad``, momentum, dampening, nesterov.
2. A parameter without a gradient is not touched (no state, same value);
   frozen parameters stay as they are.
3. ``state_dict()`` round trip: the flat optimizer's state loads into a
   per-parameter optimizer and into a flat one, and both go on bitwise; so
   does ``get/set_optimizer_state_dict`` into a fresh flat optimizer.
4. The flat path steps few tensors (the functional op's lists are counted).
5. What is not supported goes to torch's own step, with a warning.
"""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch

from tests._models import TinyLM, rank_slice, shard_blocks_and_root, token_batch
from tests.harness import run_distributed

WORLD = 3
STEPS = 4

CONFIGS = {
    "adamw-foreach-groups": ("AdamW", dict(foreach=True), [
        dict(weight_decay=0.1, lr=1e-2, betas=(0.8, 0.95)), dict(weight_decay=0.0, lr=3e-3)]),
    "adamw-loop-amsgrad-maximize": ("AdamW", dict(foreach=False, amsgrad=True, maximize=True), [
        dict(weight_decay=0.1, lr=1e-2), dict(weight_decay=0.0, lr=2e-2, eps=1e-6)]),
    "adamw-foreach-amsgrad": ("AdamW", dict(foreach=True, amsgrad=True), [dict(lr=1e-2)]),
    "adam-l2-default": ("Adam", dict(weight_decay=0.05), [dict(lr=1e-2)]),
    "sgd-foreach-nesterov": ("SGD", dict(foreach=True, momentum=0.9, nesterov=True), [
        dict(lr=0.05, weight_decay=0.01), dict(lr=0.02)]),
    "sgd-loop-dampening-maximize": ("SGD", dict(foreach=False, momentum=0.8, dampening=0.3,
                                                maximize=True), [dict(lr=0.05)]),
    "sgd-plain": ("SGD", dict(lr=0.1), [dict()]),
}


# ------------------------------------------------------------------ helpers
def _model() -> TinyLM:
    torch.manual_seed(1234)
    return shard_blocks_and_root(TinyLM(n_blocks=3))


def _optimizer(model, config: str) -> torch.optim.Optimizer:
    """Groups by position (every other parameter): runs of one group are
    cut by the other's parameters, in every buffer."""
    cls, common, groups = CONFIGS[config]
    params = [p for p in model.parameters() if p.requires_grad]
    split = [dict(group, params=params[i::len(groups)]) for i, group in enumerate(groups)]
    kwargs = dict(common)
    kwargs.setdefault("lr", 1e-2)
    return getattr(torch.optim, cls)(split, **kwargs)


def _train_step(model, optim, step: int, skip_head: bool = False) -> None:
    import torch.distributed as dist
    tokens, targets = token_batch(step, 6)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = rank_slice(tokens, rank, world), rank_slice(targets, rank, world)
    if skip_head:  # lm_head takes no part: its .grad stays None
        loss = model(tokens, head=False).square().mean()
    else:
        loss = model.loss(tokens, targets)
    loss.backward()
    optim.step()
    optim.zero_grad()


def _differences(model_a, optim_a, model_b, optim_b) -> list[str]:
    """Names of parameters or state entries that are not bitwise equal."""
    out = []
    params_b = dict(model_b.named_parameters())
    for name, a in model_a.named_parameters():
        b = params_b[name]
        if not torch.equal(a.detach(), b.detach()):
            out.append(name)
        sa, sb = optim_a.state.get(a, {}), optim_b.state.get(b, {})
        if sorted(sa) != sorted(sb):
            out.append(f"{name}: state keys {sorted(sa)} != {sorted(sb)}")
            continue
        for key in sa:
            if sa[key].shape != sb[key].shape or not torch.equal(sa[key], sb[key]):
                out.append(f"{name}.{key}")
    return out


# ------------------------------------------------------------ 1. bitwise
def _bitwise_work(config: str) -> list[str]:
    from fsdp_compose import flat_step
    model_a, model_b = _model(), _model()
    optim_a, optim_b = _optimizer(model_a, config), _optimizer(model_b, config)
    handle = flat_step(optim_b)
    out = []
    for step in range(STEPS):
        _train_step(model_a, optim_a, step)
        _train_step(model_b, optim_b, step)
        out += [f"step {step}: {d}" for d in _differences(model_a, optim_a, model_b, optim_b)]
        if handle.last.torch_params or handle.last.reasons:
            out.append(f"step {step}: left to torch: {handle.last}")
    return out + _nonzero_padding(model_b)


def _nonzero_padding(model) -> list[str]:
    """Shard elements no parameter views (padding, stepped with the runs)
    must stay zero."""
    from fsdp_compose.runtime.owners import owner_of
    out, seen = [], set()
    for name, param in model.named_parameters():
        buffer = owner_of(param).buffer
        if id(buffer) in seen:
            continue
        seen.add(id(buffer))
        covered = torch.zeros(buffer.layout.shard_numel, dtype=torch.bool)
        for s in buffer.local_slices():
            covered[s.shard_start:s.shard_start + s.length] = True
        if buffer.sharded[~covered].any():
            out.append(f"padding of the buffer of {name} is not zero")
    return out


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_bitwise_equal_to_torchs_per_parameter_step(config):
    for rank, differences in enumerate(run_distributed(WORLD, _bitwise_work, config)):
        assert not differences, f"rank {rank}: {differences}"


def _capped_work(config: str) -> dict:
    from fsdp_compose.optim import segments
    segments.CPU_RUN_CAP = 16  # runs of at most 16 elements unless one parameter is larger
    try:
        from fsdp_compose import flat_step
        model_a, model_b = _model(), _model()
        optim_a, optim_b = _optimizer(model_a, config), _optimizer(model_b, config)
        handle = flat_step(optim_b)
        out = {"differences": [], "tensors": []}
        for step in range(STEPS):
            _train_step(model_a, optim_a, step)
            _train_step(model_b, optim_b, step)
            out["tensors"].append(handle.last.flat_tensors)
        out["differences"] = _differences(model_a, optim_a, model_b, optim_b)
        return out
    finally:
        segments.CPU_RUN_CAP = 1 << 18


@pytest.mark.parametrize("config", ["adamw-foreach-amsgrad", "sgd-loop-dampening-maximize"])
def test_runs_cut_at_the_cpu_cap_stay_bitwise(config):
    results = run_distributed(WORLD, _capped_work, config)
    for rank, out in enumerate(results):
        assert not out["differences"], f"rank {rank}: {out['differences']}"
    # one group: one run per buffer (4) without the cap (rank 0 holds one
    # parameter of each buffer, the others several)
    assert max(min(out["tensors"]) for out in results) > 4, [out["tensors"] for out in results]


def _momentum_switch_work() -> list[str]:
    from fsdp_compose import flat_step
    model_a, model_b = _model(), _model()
    optim_a, optim_b = _optimizer(model_a, "sgd-plain"), _optimizer(model_b, "sgd-plain")
    flat_step(optim_b)
    for step in range(2 * STEPS):
        if step == STEPS:  # stateless until now: the first momentum step clones the gradient
            for optim in (optim_a, optim_b):
                optim.param_groups[0].update(momentum=0.9, dampening=0.5)
        _train_step(model_a, optim_a, step)
        _train_step(model_b, optim_b, step)
    return _differences(model_a, optim_a, model_b, optim_b)


def test_momentum_switched_on_later_starts_as_torchs():
    for rank, differences in enumerate(run_distributed(WORLD, _momentum_switch_work)):
        assert not differences, f"rank {rank}: {differences}"


# ------------------------------------------------- 2. parameters without a gradient
def _no_grad_work(config: str) -> dict:
    from fsdp_compose import flat_step
    model_a, model_b = _model(), _model()
    model_a.blocks[1].fc2.weight.requires_grad_(False)  # frozen, not in the optimizers
    model_b.blocks[1].fc2.weight.requires_grad_(False)
    optim_a, optim_b = _optimizer(model_a, config), _optimizer(model_b, config)
    flat_step(optim_b)
    head_before = model_b.lm_head.weight.detach().clone()
    frozen_before = model_b.blocks[1].fc2.weight.detach().clone()
    out: dict = {"differences": []}
    for step in range(STEPS):  # the head takes part from the third step on
        _train_step(model_a, optim_a, step, skip_head=step < 2)
        _train_step(model_b, optim_b, step, skip_head=step < 2)
        out["differences"] += [f"step {step}: {d}"
                               for d in _differences(model_a, optim_a, model_b, optim_b)]
        if step == 1:
            out["head_unchanged"] = torch.equal(model_b.lm_head.weight.detach(), head_before)
            out["head_state"] = sorted(optim_b.state.get(model_b.lm_head.weight, {}))
    out["frozen_unchanged"] = torch.equal(model_b.blocks[1].fc2.weight.detach(), frozen_before)
    return out


@pytest.mark.parametrize("config", ["adamw-foreach-groups", "sgd-foreach-nesterov"])
def test_a_parameter_without_gradient_is_not_touched(config):
    for rank, out in enumerate(run_distributed(WORLD, _no_grad_work, config)):
        assert not out["differences"], f"rank {rank}: {out['differences']}"
        assert out["head_unchanged"], f"rank {rank}: the head moved without a gradient"
        assert out["head_state"] == [], f"rank {rank}: state {out['head_state']} for the head"
        assert out["frozen_unchanged"], f"rank {rank}"


# ---------------------------------------------------------- 3. state dict
def _two_steps_both_ways(config: str) -> tuple:
    """Two steps of the same model with torch's per-parameter step (a) and
    with ``flat_step`` (b)."""
    from fsdp_compose import flat_step
    model_a, model_b = _model(), _model()
    optim_a, optim_b = _optimizer(model_a, config), _optimizer(model_b, config)
    flat_step(optim_b)
    for step in range(2):
        _train_step(model_a, optim_a, step)
        _train_step(model_b, optim_b, step)
    return model_a, optim_a, model_b, optim_b


def _round_trip_work(config: str) -> list[str]:
    from fsdp_compose import flat_step
    from fsdp_compose.checkpoint import register_optimizer
    model_a, optim_a, model_b, optim_b = _two_steps_both_ways(config)
    out = []
    saved_a, saved_b = optim_a.state_dict(), optim_b.state_dict()
    for key, values in saved_a["state"].items():
        for name, value in values.items():
            other = saved_b["state"][key][name]
            if not torch.equal(value.full_tensor() if hasattr(value, "full_tensor") else value,
                               other.full_tensor() if hasattr(other, "full_tensor") else other):
                out.append(f"state_dict {key}.{name}")
    # load the flat optimizer's state into a per-parameter one and into a flat one
    copies = []
    for flat in (False, True):
        model = _model()
        model.load_state_dict(model_b.state_dict())
        optim = _optimizer(model, config)
        if flat:
            flat_step(optim)
        register_optimizer(optim)
        optim.load_state_dict(copy.deepcopy(optim_b.state_dict()))  # torch keeps 'step' objects
        copies.append((model, optim))
    for step in range(2, 2 + STEPS):
        _train_step(model_a, optim_a, step)
        for model, optim in copies:
            _train_step(model, optim, step)
    for (model, optim), what in zip(copies, ("per-parameter", "flat")):
        out += [f"{what}: {d}" for d in _differences(model_a, optim_a, model, optim)]
    return out


@pytest.mark.parametrize("config", ["adamw-loop-amsgrad-maximize", "sgd-foreach-nesterov"])
def test_state_dict_round_trip_into_either_optimizer(config):
    for rank, differences in enumerate(run_distributed(WORLD, _round_trip_work, config)):
        assert not differences, f"rank {rank}: {differences}"


def _dcp_round_trip_work(config: str) -> list[str]:
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    from fsdp_compose import flat_step
    model_a, optim_a, model_b, optim_b = _two_steps_both_ways(config)
    model_c = _model()
    optim_c = _optimizer(model_c, config)
    flat_step(optim_c)  # never stepped: torch's state initialisation runs first
    set_model_state_dict(model_c, get_model_state_dict(model_b))
    set_optimizer_state_dict(model_c, optim_c,
                             copy.deepcopy(get_optimizer_state_dict(model_b, optim_b)))
    for step in range(2, 2 + STEPS):
        _train_step(model_a, optim_a, step)
        _train_step(model_c, optim_c, step)
    return _differences(model_a, optim_a, model_c, optim_c)


@pytest.mark.parametrize("config", ["adamw-foreach-groups", "sgd-loop-dampening-maximize"])
def test_get_and_set_optimizer_state_dict_into_a_fresh_flat_optimizer(config):
    for rank, differences in enumerate(run_distributed(WORLD, _dcp_round_trip_work, config)):
        assert not differences, f"rank {rank}: {differences}"


def _remove_work() -> list[str]:
    from fsdp_compose import flat_step
    model_a, model_b = _model(), _model()
    optim_a = _optimizer(model_a, "adamw-foreach-groups")
    optim_b = _optimizer(model_b, "adamw-foreach-groups")
    handle = flat_step(optim_b)
    out = []
    for step in range(2 * STEPS):
        if step == STEPS:
            handle.remove()  # torch's own step from here, on the same state
            out += ["step still replaced"] if "step" in optim_b.__dict__ else []
        _train_step(model_a, optim_a, step)
        _train_step(model_b, optim_b, step)
    return out + _differences(model_a, optim_a, model_b, optim_b)


def test_remove_returns_to_torchs_step_on_the_same_state():
    for rank, differences in enumerate(run_distributed(WORLD, _remove_work)):
        assert not differences, f"rank {rank}: {differences}"


# --------------------------------------------------------- 4. few tensors
def _count_work(flat: bool) -> dict:
    from fsdp_compose import flat_step
    adam_module = importlib.import_module("torch.optim.adam")
    model = _model()
    optim = _optimizer(model, "adamw-foreach-groups")
    if flat:
        flat_step(optim)
    lengths = []
    original = adam_module.adam

    def counting(params, *args, **kwargs):
        lengths.append(len(params))
        return original(params, *args, **kwargs)

    adam_module.adam = counting
    try:
        _train_step(model, optim, 0)
        _train_step(model, optim, 1)
    finally:
        adam_module.adam = original
    return {"lengths": lengths, "params": len(list(model.parameters()))}


def test_the_flat_path_steps_few_tensors():
    per_param = run_distributed(WORLD, _count_work, False)
    flat = run_distributed(WORLD, _count_work, True)
    for rank in range(WORLD):
        # torch: one tensor per parameter; flat: one call per group and step,
        # one tensor per run (the groups alternate: runs are cut by the other's)
        assert sum(per_param[rank]["lengths"]) == 2 * per_param[rank]["params"]
        assert len(flat[rank]["lengths"]) == 4, flat[rank]
        assert sum(flat[rank]["lengths"]) < 2 * flat[rank]["params"], flat[rank]


def _runs_of_one_group_work() -> list[int]:
    from fsdp_compose import flat_step
    adam_module = importlib.import_module("torch.optim.adam")
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    flat_step(optim)
    lengths = []
    original = adam_module.adam
    adam_module.adam = lambda params, *a, **k: (lengths.append(len(params)),
                                                     original(params, *a, **k))[1]
    try:
        _train_step(model, optim, 0)
    finally:
        adam_module.adam = original
    return lengths


def test_one_group_steps_one_tensor_per_buffer():
    for rank, lengths in enumerate(run_distributed(WORLD, _runs_of_one_group_work)):
        assert lengths == [4], f"rank {rank}: {lengths} (3 blocks and the root: 4 buffers)"


# ------------------------------------------------------------- 5. fallback
def _fallback_work() -> dict:
    from fsdp_compose import flat_step
    model_a, model_b = _model(), _model()
    optim_a = torch.optim.AdamW(model_a.parameters(), lr=1e-2, foreach=False)
    optim_b = torch.optim.AdamW(model_b.parameters(), lr=1e-2, foreach=False)
    handle = flat_step(optim_b)
    optim_b.param_groups[0]["differentiable"] = True
    optim_a.param_groups[0]["differentiable"] = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_step(model_a, optim_a, 0)
        _train_step(model_b, optim_b, 0)
    rmsprop = torch.optim.RMSprop(_model().parameters())
    with warnings.catch_warnings(record=True) as caught_class:
        warnings.simplefilter("always")
        other = flat_step(rmsprop)
    return {"differences": _differences(model_a, optim_a, model_b, optim_b),
            "report": handle.last, "warned": [str(w.message) for w in caught],
            "class": other.unsupported, "class_warned": [str(w.message) for w in caught_class]}


def test_what_is_not_supported_is_stepped_by_torch_and_said():
    for rank, out in enumerate(run_distributed(WORLD, _fallback_work)):
        assert not out["differences"], f"rank {rank}: {out['differences']}"
        assert out["report"].flat_params == 0 and out["report"].reasons, out["report"]
        assert any("differentiable=True" in w for w in out["warned"]), out["warned"]
        assert "RMSprop" in out["class"] and out["class_warned"], out


def test_an_lr_scheduler_made_first_is_refused_with_the_fix():
    from fsdp_compose import flat_step
    optim = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    torch.optim.lr_scheduler.StepLR(optim, 1)
    with pytest.raises(ValueError, match="before the LR scheduler"):
        flat_step(optim)
