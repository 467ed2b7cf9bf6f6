"""Parameters, modules and ``replicate`` added after ``fully_shard``, in the
steady state: every way in is still an error on every rank after the
forwards have settled into the fast check (checks/late_parameters.py,
[Note: the late-parameter fast check]), and the fast check really is what
runs once nothing changes. ``tests/tools/test_hf.py`` (section 8) covers additions
made before the first forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests._models import tiny_gpt
from tests.harness import run_distributed

STEPS_BEFORE = 3


def _step(model, optim, seed: int) -> None:
    from fsdp_compose.testing import synthetic_tokens

    tokens, targets = synthetic_tokens(seed, 2, 8, 32)
    model.loss(tokens, targets).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _add_late(kind: str) -> dict:
    """Train a few steps, then add something the units do not manage."""
    from fsdp_compose.testing import GPTConfig
    from fsdp_compose.testing.gpt import Block

    model = tiny_gpt()
    # built before the steps: its own registrations must not be what reveals the insertion
    spare = Block(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for seed in range(STEPS_BEFORE):
        _step(model, optim, seed)
    block = model.blocks[1]
    if kind == "replaced-by-setattr":  # same name: seen by the registration hooks
        block.attn.proj.weight = nn.Parameter(torch.zeros(16, 16))
    elif kind == "into-a-none-slot":  # bias=False keeps a None entry: the same size
        model.head.bias = nn.Parameter(torch.zeros(32))
    elif kind == "modulelist-insert":  # writes _modules directly: seen by its size
        model.blocks.insert(1, spare)
    elif kind == "direct-new-name":  # private write, new name: seen by the size
        block.ln1._parameters["shift"] = nn.Parameter(torch.zeros(16))
    elif kind == "direct-same-name":  # private write, same size, no hook: seen at the unshard
        block.attn.proj._parameters["weight"] = nn.Parameter(torch.zeros(16, 16))
    elif kind == "replicate":  # a registry appears in the submodule's __dict__
        from torch.distributed._composable import replicate
        replicate(block.mlp)
    try:
        _step(model, optim, STEPS_BEFORE)
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"error": None}


@pytest.mark.parametrize("kind,fragment", [
    ("replaced-by-setattr", "parameter 'blocks.1.attn.proj.weight' was replaced"),
    ("into-a-none-slot", "parameter 'head.bias' was registered"),
    ("modulelist-insert", "parameter 'blocks.1.ln1.weight' was registered"),
    ("direct-new-name", "parameter 'blocks.1.ln1.shift' was registered"),
    ("direct-same-name", "parameter 'blocks.1.attn.proj.weight' (attribute 'weight' of Linear) "
                         "was replaced"),
    ("replicate", "module 'blocks.1.mlp' was annotated by replicate() after fully_shard"),
])
def test_an_addition_after_training_steps_is_an_error_on_every_rank(kind, fragment):
    for result in run_distributed(2, _add_late, kind):
        assert result["error"] is not None, f"{kind}: silently accepted"
        assert fragment in result["error"], result["error"]


def _full_checks_per_step(change: str) -> list[int]:
    """Full comparisons (not the fast check) made in each of three steps
    after warm-up; with ``change``, a harmless change before the second."""
    from unittest import mock

    from fsdp_compose.checks import late_parameters

    model = tiny_gpt()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for seed in range(STEPS_BEFORE):
        _step(model, optim, seed)
    counts = []
    with mock.patch.object(late_parameters, "_check_params",
                           wraps=late_parameters._check_params) as full:
        for seed in range(3):
            if change == "parameterless-child" and seed == 1:
                model.blocks[0].mlp.append(nn.Identity())  # no parameters: allowed
            if change == "another-model" and seed == 1:
                nn.Linear(4, 4)  # registrations elsewhere in the process
            before = full.call_count
            _step(model, optim, STEPS_BEFORE + seed)
            counts.append(full.call_count - before)
    return counts


def test_the_steady_state_runs_only_the_fast_check():
    counts, = run_distributed(1, _full_checks_per_step, "none")
    assert counts == [0, 0, 0], counts


@pytest.mark.parametrize("change", ["parameterless-child", "another-model"])
def test_a_harmless_change_costs_one_full_check_then_the_fast_one(change):
    counts, = run_distributed(1, _full_checks_per_step, change)
    assert counts[0] == 0 and counts[2] == 0, counts
    assert counts[1] > 0, f"the change went unseen: {counts}"
