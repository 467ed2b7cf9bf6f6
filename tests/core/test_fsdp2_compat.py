"""Code written against torch FSDP2's ``fully_shard`` means the same here
: positional arguments, torch's policy objects and ``recurse`` on the
module methods.

Run: ``PYTHONPATH=. python -m pytest -q tests/core/test_fsdp2_compat.py``.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn

import fsdp_compose
from fsdp_compose import (CPUOffloadPolicy, MixedPrecisionPolicy, ShardedModule, fully_shard,
                          param_info)
from tests._models import (PER_RANK, assemble_grads, assert_dicts_close, build_lm, full_params,
                           grad_pieces, make_optim, rank_slice, rank_world, token_batch)
from tests.harness import run_distributed

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TIMEOUT = 60


# ============================================================================
# 1. positional order: FSDP2's, or keyword-only
# ============================================================================
def test_mixed_precision_policy_positional_arguments_mean_what_they_mean_in_fsdp2():
    args = (BF16, FP32, FP16, False)
    ours, theirs = MixedPrecisionPolicy(*args), torch_fsdp.MixedPrecisionPolicy(*args)
    for field in dataclasses.fields(theirs):
        assert getattr(ours, field.name) == getattr(theirs, field.name), field.name
    assert ours.reduce_comm_dtype is None and ours.buffer_dtype is None
    with pytest.raises(TypeError):  # our own fields cannot be given by position
        MixedPrecisionPolicy(BF16, FP32, FP16, False, BF16)
    kw = MixedPrecisionPolicy(BF16, reduce_comm_dtype=BF16, buffer_dtype=FP16)
    assert (kw.reduce_comm_dtype, kw.buffer_dtype, kw.output_dtype) == (BF16, FP16, None)


def _positional(signature: inspect.Signature) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in signature.parameters.values() if p.kind in kinds]


def _shared_callables() -> list[tuple[str, object, object]]:
    pairs = [("MixedPrecisionPolicy", MixedPrecisionPolicy, torch_fsdp.MixedPrecisionPolicy),
             ("CPUOffloadPolicy", CPUOffloadPolicy, torch_fsdp.CPUOffloadPolicy),
             ("fully_shard", fully_shard, torch_fsdp.fully_shard)]
    for name in dir(torch_fsdp.FSDPModule):
        if not name.startswith("_") and hasattr(ShardedModule, name):
            pairs.append((name, getattr(ShardedModule, name), getattr(torch_fsdp.FSDPModule, name)))
    return pairs


SHARED = _shared_callables()


@pytest.mark.parametrize("name,ours,theirs", SHARED, ids=[p[0] for p in SHARED])
def test_every_name_shared_with_fsdp2_takes_fsdp2s_positional_order(name, ours, theirs):
    """Whatever we take by position, FSDP2 takes by position at the same
    place under the same name (anything else of ours is keyword-only), so
    no positional call written for FSDP2 silently means something else."""
    mine, fsdp2 = _positional(inspect.signature(ours)), _positional(inspect.signature(theirs))
    assert mine == fsdp2[:len(mine)], f"{name}: ours {mine}, FSDP2 {fsdp2}"


RECURSE = ["set_requires_gradient_sync", "set_reshard_after_forward",
           "set_reshard_after_backward", "set_reduce_scatter_unused_params",
           "set_gradient_divide_factor", "set_force_sum_reduction_for_comms"]


@pytest.mark.parametrize("name", RECURSE)
def test_setters_accept_recurse(name):
    """FSDP2's setters with ``recurse`` (and the two divide/sum setters,
    which FSDP2 applies to one module only) take ``recurse`` here too,
    positionally exactly where FSDP2 takes it so."""
    params = inspect.signature(getattr(ShardedModule, name)).parameters
    assert "recurse" in params and params["recurse"].default is True
    if not hasattr(torch_fsdp.FSDPModule, name):  # torch 2.11 has no set_reduce_scatter_unused_params
        pytest.skip(f"torch {torch.__version__}'s FSDP2 has no {name} to compare with")
    theirs = inspect.signature(getattr(torch_fsdp.FSDPModule, name)).parameters
    if "recurse" in theirs:
        assert params["recurse"].kind == theirs["recurse"].kind


# ============================================================================
# 4. torch's policy objects are accepted
# ============================================================================
def _local_batch(step: int):
    rank, world = rank_world()
    tokens, targets = token_batch(step, world * PER_RANK, seed=23)
    return rank_slice(tokens, rank, world), rank_slice(targets, rank, world)


def train_with_policies(kind: str, steps: int = 3) -> dict:
    """TinyLM, blocks under a bf16 mixed precision policy with fp32 outputs
    and a CPU offload policy, the root under the "no policy" objects;
    ``kind`` picks whose classes (``"torch"`` or ``"ours"``)."""
    lib = torch_fsdp if kind == "torch" else fsdp_compose
    mp = lib.MixedPrecisionPolicy(BF16, FP32, FP32)  # outputs back to fp32 for the root
    offload = lib.CPUOffloadPolicy(pin_memory=False)
    model = build_lm(2)
    seen = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, a: seen.append(m.fc1.weight.dtype))
        fully_shard(block, mp_policy=mp, offload_policy=offload)
    none_kw = {"mp_policy": torch_fsdp.MixedPrecisionPolicy(),
               "offload_policy": torch_fsdp.OffloadPolicy()} if kind == "torch" else {}
    fully_shard(model, **none_kw)
    optim = make_optim(model.parameters(), "sgd")
    losses, out_dtypes = [], set()
    for step in range(steps):
        tokens, targets = _local_batch(step)
        model.blocks[0].register_forward_hook(lambda m, a, out: out_dtypes.add(out.dtype))
        loss = model.loss(tokens, targets)
        loss.backward()
        losses.append(loss.item())
        optim.step()
        optim.zero_grad()
    return {"losses": losses, "params": full_params(model), "compute": set(seen),
            "outputs": out_dtypes, "root_param": model.lm_head.weight.dtype}


def test_torch_policies_train_exactly_like_ours():
    theirs = run_distributed(2, train_with_policies, "torch", timeout=TIMEOUT)
    ours = run_distributed(2, train_with_policies, "ours", timeout=TIMEOUT)
    for a, b in zip(theirs, ours):
        assert a["compute"] == {BF16} and a["outputs"] == {FP32} and a["root_param"] == FP32
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in b["params"])


@dataclasses.dataclass(frozen=True)
class _FutureTorchPolicy(torch_fsdp.MixedPrecisionPolicy):
    """A torch policy with a field fsdp_compose does not have."""

    stochastic_rounding: bool = False


class _SpillPolicy(torch_fsdp.OffloadPolicy):
    """An offload policy torch might add (not CPU offload)."""


def unconvertible_policies() -> list[str]:
    messages = []
    for kw in ({"mp_policy": object()}, {"offload_policy": "cpu"},
               {"mp_policy": _FutureTorchPolicy(param_dtype=BF16, stochastic_rounding=True)},
               {"offload_policy": _SpillPolicy()}):
        with pytest.raises(TypeError) as info:
            fully_shard(nn.Linear(3, 5), **kw)
        messages.append(str(info.value))
    # at its default, the extra field is dropped and the rest converted
    fully_shard(nn.Linear(3, 5), mp_policy=_FutureTorchPolicy(param_dtype=BF16))
    return messages


def test_unconvertible_policies_name_both_packages():
    wrong_mp, wrong_offload, extra_field, unknown_offload = run_distributed(
        1, unconvertible_policies)[0]
    ours_mp, torch_mp = "fsdp_compose.policies.MixedPrecisionPolicy", \
        "torch.distributed.fsdp.MixedPrecisionPolicy"
    assert ours_mp in wrong_mp and torch_mp in wrong_mp and "builtins.object" in wrong_mp
    assert "fsdp_compose.policies.CPUOffloadPolicy" in wrong_offload
    assert "torch.distributed.fsdp.CPUOffloadPolicy" in wrong_offload
    assert "builtins.str" in wrong_offload
    assert "stochastic_rounding" in extra_field and ours_mp in extra_field
    assert "tests.core.test_fsdp2_compat._FutureTorchPolicy" in extra_field
    assert "tests.core.test_fsdp2_compat._SpillPolicy" in unknown_offload


# ============================================================================
# 5. recurse on the setters
# ============================================================================
def grads_with_divide_factor(recurse: bool) -> dict:
    """One backward with ``set_gradient_divide_factor(1.0, recurse=...)``
    on the root: summed gradients in the units it reached, means elsewhere."""
    model = build_lm(2)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.set_gradient_divide_factor(1.0, recurse=recurse)
    tokens, targets = _local_batch(0)
    model.loss(tokens, targets).backward()
    return grad_pieces(model)


def mean_grads() -> dict:
    model = build_lm(2)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    tokens, targets = _local_batch(0)
    model.loss(tokens, targets).backward()
    return grad_pieces(model)


def test_gradient_divide_factor_recurse():
    world = 2
    mean = assemble_grads(run_distributed(world, mean_grads, timeout=TIMEOUT))
    for recurse in (True, False):
        got = assemble_grads(run_distributed(world, grads_with_divide_factor, recurse,
                                             timeout=TIMEOUT))
        want = {n: g * (world if recurse or not n.startswith("blocks.") else 1)
                for n, g in mean.items()}
        assert_dicts_close(got, want, 1e-6, f"recurse={recurse}: gradient of ")


def reshard_after_forward_recurse(recurse_args: tuple) -> list[int]:
    """Whether block 0's and the root's weights are unsharded right after the
    root's forward, with ``set_reshard_after_forward(False, *recurse_args)``."""
    model = build_lm(2)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model, reshard_after_forward=True)
    model.set_reshard_after_forward(False, *recurse_args)  # FSDP2 takes recurse by position
    force_sum_on = _force_sum_flags(model, recurse_args)
    tokens, targets = _local_batch(0)
    params = [model.blocks[0].fc1.weight, model.lm_head.weight]  # the sharded nn.Parameters
    full_shapes = [param_info(p).shape for p in params]
    loss = model.loss(tokens, targets)
    # unsharded: the module attribute is a view of the gathered buffer in the full
    # shape; resharded: the sharded parameter again (under the default placement its
    # shape alone need not tell: a rank may hold all rows of a parameter)
    now = [model.blocks[0].fc1.weight, model.lm_head.weight]
    unsharded = [int(w is not p and w.shape == shape)
                 for w, p, shape in zip(now, params, full_shapes)]
    assert all(w is p or w.shape == shape for w, p, shape in zip(now, params, full_shapes))
    loss.backward()
    return unsharded + force_sum_on


def _force_sum_flags(model: nn.Module, recurse_args: tuple) -> list[int]:
    from fsdp_compose.runtime.state import state_of
    model.set_force_sum_reduction_for_comms(True, recurse=bool(recurse_args[0]) if recurse_args
                                            else True)
    return [int(state_of(m).unit.settings.reduce_options.force_sum) for m in (model.blocks[0], model)]


@pytest.mark.parametrize("recurse_args,want", [((), [1, 1, 1, 1]), ((True,), [1, 1, 1, 1]),
                                               ((False,), [0, 1, 0, 1])])
def test_reshard_after_forward_and_force_sum_recurse(recurse_args, want):
    """Weights: 1 = still unsharded after forward (whole), 0 = resharded."""
    for got in run_distributed(2, reshard_after_forward_recurse, recurse_args, timeout=TIMEOUT):
        assert got == want


def test_every_public_fsdp_module_method_exists_on_sharded_module():
    """A torch that adds a public method to FSDPModule fails here until the
    library has it (and docs/migrating-from-fsdp2.md's method table says
    what it does)."""
    theirs = {n for n in dir(torch_fsdp.FSDPModule) if not n.startswith("_")}
    missing = sorted(n for n in theirs if not callable(getattr(ShardedModule, n, None)))
    assert not missing, f"FSDPModule methods missing on ShardedModule: {missing}"
    table = open("docs/migrating-from-fsdp2.md").read()
    undocumented = sorted(n for n in theirs if f"`{n}`" not in table and f"`{n}(" not in table)
    assert not undocumented, f"not in docs/migrating-from-fsdp2.md: {undocumented}"
    assert fsdp_compose.FSDPModule is ShardedModule
