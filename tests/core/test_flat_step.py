"""The flat optimizer step: the optimizer steps each buffer's shard as a
few flat tensors, bitwise equal to torch's own per-parameter step; the
default for an optimizer over annotated parameters, with no call.

Every rank trains two copies of the same sharded model on the same batches
(world size 3, uneven shapes: padding, and ranks holding none of a small
parameter), one optimizer stepped by torch (``flat_step(optim,
enabled=False)``), one left to the default or given ``flat_step``; after
every step the parameters and the optimizer state must be bitwise equal.

1. AdamW/Adam/SGD, foreach and for-loop, weight decay, per-group
   hyperparameters, ``maximize``, ``amsgrad``, momentum, dampening, nesterov;
   nanoGPT's and the HF Trainer's weight-decay groups, stepped as one call
   with one tensor per buffer; an LR scheduler made before the first step;
   a param group added later.
2. A parameter without a gradient is not touched (no state, same value);
   frozen parameters stay as they are.
3. ``state_dict()`` round trip: the flat optimizer's state loads into a
   per-parameter optimizer and into a flat one, and both go on bitwise; so
   does ``get/set_optimizer_state_dict`` into a fresh flat optimizer.
4. The flat path steps few tensors (the functional op's lists are counted).
5. What is not supported goes to torch's own step, with a warning; the
   default says so once, and ``enabled=False`` silences it.
6. Weight-decay groups in one call; LR schedulers; a group added later.
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
    "adamw-nanogpt-groups": ("AdamW", dict(foreach=False), [
        dict(weight_decay=0.1), dict(weight_decay=0.0)]),
    "adamw-hf-groups": ("AdamW", dict(foreach=True, betas=(0.9, 0.999)), [
        dict(weight_decay=0.05), dict(weight_decay=0.0)]),
}
"""Groups: by position (every other parameter) unless the name says whose rule."""


def _split(model, config: str) -> list[list]:
    """The parameters of each group: nanoGPT's (decay for >= 2-D, none for
    1-D), the HF Trainer's (none for biases and norm weights), or by
    position (every other parameter: runs of one group are cut by the
    other's, in every buffer)."""
    from fsdp_compose import param_info
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if "nanogpt" in config:
        decay = [len(param_info(p).shape) >= 2 for _, p in named]
    elif "hf-groups" in config:
        decay = [not (n.endswith("bias") or "norm" in n) for n, _ in named]
    else:
        count = len(CONFIGS[config][2])
        return [[p for _, p in named][i::count] for i in range(count)]
    return [[p for (_, p), d in zip(named, decay) if d], [p for (_, p), d in zip(named, decay) if not d]]


# ------------------------------------------------------------------ helpers
def _model() -> TinyLM:
    torch.manual_seed(1234)
    return shard_blocks_and_root(TinyLM(n_blocks=3))


def _optimizer(model, config: str, torch_step: bool = False) -> torch.optim.Optimizer:
    """The optimizer of ``config`` (groups by :func:`_split`); ``torch_step``:
    turned off, torch's own per-parameter step (the reference)."""
    from fsdp_compose import flat_step
    cls, common, groups = CONFIGS[config]
    split = [dict(group, params=params) for group, params in zip(groups, _split(model, config))]
    kwargs = dict(common)
    kwargs.setdefault("lr", 1e-2)
    optim = getattr(torch.optim, cls)(split, **kwargs)
    if torch_step:
        flat_step(optim, enabled=False)
    return optim


def _train_step(model, optim, step: int, skip_head: bool = False,
                set_to_none: bool = True) -> None:
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
    optim.zero_grad(set_to_none=set_to_none)


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
    """The default (no call): the first step is torch's, every later one flat."""
    from fsdp_compose import flat_step
    model_a, model_b = _model(), _model()
    optim_a, optim_b = _optimizer(model_a, config, torch_step=True), _optimizer(model_b, config)
    out = []
    handle = None
    for step in range(STEPS):
        _train_step(model_a, optim_a, step, set_to_none=step % 2 == 0)
        _train_step(model_b, optim_b, step, set_to_none=step % 2 == 0)
        out += [f"step {step}: {d}" for d in _differences(model_a, optim_a, model_b, optim_b)]
        if handle is not None and (handle.last.torch_params or handle.last.reasons
                                   or not handle.last.flat_params):
            out.append(f"step {step}: left to torch: {handle.last}")
        if step == 0:  # the default took it at its first step, without a call
            if "step" not in optim_b.__dict__ or "step" in optim_a.__dict__:
                out.append("the default did not replace the step (or replaced the reference's)")
            handle = flat_step(optim_b)  # idempotent: the handle the default made
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


def _state_places_work(config: str) -> list[str]:
    """Where the default's optimizer keeps its state after torch's first step
    and after the first flat step."""
    model = _model()
    optim = _optimizer(model, config)
    places = []
    for step in range(2):
        _train_step(model, optim, step)
        names = {param: name for name, param in model.named_parameters()}
        places.append({f"{names[param]}.{key}": (value.data_ptr(), value._base is not None)
                       for param, state in optim.state.items() for key, value in state.items()
                       if key != "step"})
    out = [f"{name} is not a view of the flat state" for name, (_, view) in places[0].items()
           if not view]
    return out + [f"{name} moved at the first flat step" for name in places[0]
                  if places[1].get(name, (None,))[0] != places[0][name][0]]


@pytest.mark.parametrize("config", ["adamw-foreach-groups", "adam-l2-default"])
def test_the_default_holds_adams_state_once(config):
    """torch's first step writes into flat state laid out for it, which the
    first flat step takes over in place: no step holds the state twice."""
    for rank, problems in enumerate(run_distributed(WORLD, _state_places_work, config)):
        assert not problems, f"rank {rank}: {problems[:4]}"


def _capped_work(config: str) -> dict:
    from fsdp_compose.optim import segments
    segments.CPU_RUN_CAP = 16  # runs of at most 16 elements unless one parameter is larger
    try:
        from fsdp_compose import flat_step
        model_a, model_b = _model(), _model()
        optim_a, optim_b = _optimizer(model_a, config, torch_step=True), _optimizer(model_b, config)
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
    optim_a = _optimizer(model_a, "sgd-plain", torch_step=True)
    optim_b = _optimizer(model_b, "sgd-plain")
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
    optim_a, optim_b = _optimizer(model_a, config, torch_step=True), _optimizer(model_b, config)
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
    optim_a, optim_b = _optimizer(model_a, config, torch_step=True), _optimizer(model_b, config)
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
    # (a copy each: torch keeps the 'step' objects it loads; the second is copied
    # from the first, whose deepcopy already converted the values)
    loaded = copy.deepcopy(optim_b.state_dict())
    copies = []
    for flat in (False, True):
        model = _model()
        model.load_state_dict(model_b.state_dict())
        optim = _optimizer(model, config, torch_step=not flat)
        if flat:
            flat_step(optim)
        register_optimizer(optim)
        optim.load_state_dict(loaded if flat else copy.deepcopy(loaded))
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
    model_a, optim_a, model_b, optim_b = _two_steps_both_ways(config)
    model_c = _model()
    optim_c = _optimizer(model_c, config)  # the default: flat from its second step
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
    optim_a = _optimizer(model_a, "adamw-foreach-groups", torch_step=True)
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
    optim = _optimizer(model, "adamw-foreach-groups", torch_step=not flat)
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
    flat_step(optim_a, enabled=False)
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


def _default_fallback_work() -> dict:
    from fsdp_compose import flat_step

    class MyAdamW(torch.optim.AdamW):
        pass

    out = {}
    for name, make in (("RMSprop", torch.optim.RMSprop), ("MyAdamW", MyAdamW)):
        for silenced in (False, True):
            model = _model()
            optim = make(model.parameters(), lr=1e-3)
            if silenced:
                flat_step(optim, enabled=False)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _train_step(model, optim, 0)
                _train_step(model, optim, 1)
            out[(name, silenced)] = [str(w.message) for w in caught
                                     if "fsdp_compose" in str(w.message)]
            out[(name, silenced, "replaced")] = "step" in optim.__dict__
    return out


def test_the_default_leaves_other_optimizers_to_torch_saying_why_once():
    for rank, out in enumerate(run_distributed(WORLD, _default_fallback_work)):
        for name in ("RMSprop", "MyAdamW"):
            said = out[(name, False)]
            assert len(said) == 1 and name in said[0] and "enabled=False" in said[0], (rank, said)
            assert out[(name, True)] == [], (rank, out[(name, True)])  # the fix it proposes
            assert not out[(name, False, "replaced")] and not out[(name, True, "replaced")]


# ---------------------------------------------- 6. groups, schedulers, later groups
def _one_call_work(config: str) -> list[list[int]]:
    """Per step, the lengths of the functional calls' parameter lists."""
    adam_module = importlib.import_module("torch.optim.adam")
    model = _model()
    optim = _optimizer(model, config)
    calls: list[list[int]] = []
    original = adam_module.adam
    adam_module.adam = lambda params, *a, **k: (calls[-1].append(len(params)),
                                                original(params, *a, **k))[1]
    try:
        for step in range(3):
            calls.append([])
            _train_step(model, optim, step)
    finally:
        adam_module.adam = original
    return calls


@pytest.mark.parametrize("config", ["adamw-nanogpt-groups", "adamw-hf-groups"])
def test_weight_decay_groups_step_in_one_call_of_one_tensor_per_buffer(config):
    for rank, calls in enumerate(run_distributed(WORLD, _one_call_work, config)):
        # the first step is torch's (two groups, one tensor per parameter);
        # then one call, one run per buffer (3 blocks and the root)
        assert len(calls[0]) == 2 and sum(calls[0]) > 8, (rank, calls)
        assert calls[1:] == [[4], [4]], f"rank {rank}: {calls}"


def _scheduler_work(explicit: bool) -> dict:
    from fsdp_compose import flat_step
    config = "adamw-nanogpt-groups"
    model_a, model_b = _model(), _model()
    optim_a, optim_b = _optimizer(model_a, config, torch_step=True), _optimizer(model_b, config)
    lambdas = [lambda done: 1.0 / (1 + done), lambda done: 0.5 ** done]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambdas) for o in (optim_a, optim_b)]
    if explicit:  # after the scheduler: its wrapper is made again around the flat step
        flat_step(optim_b)
    out: dict = {"differences": [], "reports": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            for model, optim, sched in ((model_a, optim_a, scheds[0]),
                                        (model_b, optim_b, scheds[1])):
                _train_step(model, optim, step)
                sched.step()
            out["differences"] += [f"step {step}: {d}" for d in
                                   _differences(model_a, optim_a, model_b, optim_b)]
            out["reports"].append(flat_step(optim_b).last if step else None)
    out["lrs"] = [[g["lr"] for g in o.param_groups] for o in (optim_a, optim_b)]
    out["warned"] = [str(w.message) for w in caught]
    return out


@pytest.mark.parametrize("explicit", [False, True])
def test_an_lr_scheduler_made_first_keeps_working_on_the_flat_step(explicit):
    for rank, out in enumerate(run_distributed(WORLD, _scheduler_work, explicit)):
        assert not out["differences"], f"rank {rank}: {out['differences']}"
        assert out["warned"] == [], f"rank {rank}: {out['warned']}"
        assert out["lrs"][0] == out["lrs"][1] and out["lrs"][0][0] != out["lrs"][0][1], out["lrs"]
        for report in out["reports"][1:]:  # one call for the two groups until their lr differ
            assert report.flat_params and not report.torch_params, (rank, report)


def _added_group_work() -> list[str]:
    from fsdp_compose import flat_step
    model_a, model_b = _model(), _model()
    optims = []
    for model, torch_step in ((model_a, True), (model_b, False)):
        params = list(model.parameters())
        optim = torch.optim.AdamW(params[: len(params) // 2], lr=1e-2, weight_decay=0.1)
        if torch_step:
            flat_step(optim, enabled=False)
        optims.append(optim)
    out = []
    for step in range(2 * STEPS):
        if step == STEPS:
            for model, optim in zip((model_a, model_b), optims):
                params = list(model.parameters())
                optim.add_param_group({"params": params[len(params) // 2:], "weight_decay": 0.0})
        _train_step(model_a, optims[0], step)
        _train_step(model_b, optims[1], step)
        out += [f"step {step}: {d}" for d in _differences(model_a, optims[0], model_b, optims[1])]
    report = flat_step(optims[1]).last
    if report.torch_params or report.flat_params != len(list(model_b.parameters())):
        out.append(f"last step: {report}")
    return out


def test_a_param_group_added_later_steps_flat_with_the_others():
    for rank, differences in enumerate(run_distributed(WORLD, _added_group_work)):
        assert not differences, f"rank {rank}: {differences}"


def _dropped_work() -> dict:
    import gc
    import weakref
    out = {}
    for name, scheduled in (("plain", False), ("scheduled", True)):
        model = _model()
        optim = _optimizer(model, "adamw-nanogpt-groups")
        sched = torch.optim.lr_scheduler.StepLR(optim, 1) if scheduled else None
        for step in range(2):
            _train_step(model, optim, step)
        out[f"{name} replaced"] = "step" in optim.__dict__
        ref = weakref.ref(optim)
        gc.disable()  # freed by reference counting: the flat step makes no cycle through it
        try:
            del optim, sched
            out[f"{name} freed"] = ref() is None
        finally:
            gc.enable()
    return out


def test_an_optimizer_on_the_flat_step_is_freed_when_dropped():
    for rank, out in enumerate(run_distributed(WORLD, _dropped_work)):
        assert all(out.values()), f"rank {rank}: {out}"
