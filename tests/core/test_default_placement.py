"""The default placement keeps shapes: recipes that select
parameters by ``p.dim()`` / ``p.ndim`` pick what torch FSDP2 picks and
train like one process, with no change to the user's code; empty optimizer
groups are named and do not break a resume.

Run: PYTHONPATH=$PWD python -m pytest -q tests/core/test_default_placement.py
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from fsdp_compose import fully_shard, param_info
from fsdp_compose.testing import GPT, GPTConfig, synthetic_tokens
from tests._training import assert_parity, train_reference, train_sharded
from tests.harness import run_distributed

TIMEOUT = 120


def _selections(model: torch.nn.Module) -> dict[str, set[str]]:
    """The FQNs each recipe's rule picks on ``model`` as it is now."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return {"nanogpt_decay": {n for n, p in named if p.dim() >= 2},
            "muon_matrices": {n for n, p in named if p.ndim == 2},
            "ndim_kept": {n for n, p in named if p.ndim == len(param_info(p).shape)}
            if all(param_info(p) is not None for _, p in named) else set()}


def selections_worker() -> dict:
    """Ours under the default placement, and torch FSDP2, on the same model."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    torch.manual_seed(0)
    ours, theirs = GPT(GPTConfig()), GPT(GPTConfig())
    for block in ours.blocks:
        fully_shard(block)
    fully_shard(ours)
    for block in theirs.blocks:
        torch_fully_shard(block)
    torch_fully_shard(theirs)
    return {"ours": _selections(ours), "fsdp2": _selections(theirs),
            "all": {n for n, _ in ours.named_parameters()}}


@pytest.mark.parametrize("world", [2, 3])
def test_dimension_rules_pick_what_fsdp2_picks(world):
    """nanoGPT's ``p.dim() >= 2`` and Muon's ``p.ndim == 2`` select the same
    parameters as under torch FSDP2 (and as in one process), on every rank;
    every parameter keeps its number of dimensions (the GPT has no 0-dim
    parameter)."""
    plain = GPT(GPTConfig())
    want = {"nanogpt_decay": {n for n, p in plain.named_parameters() if p.dim() >= 2},
            "muon_matrices": {n for n, p in plain.named_parameters() if p.ndim == 2}}
    assert want["nanogpt_decay"] and want["nanogpt_decay"] != {n for n, _ in plain.named_parameters()}
    for rank, got in enumerate(run_distributed(world, selections_worker, timeout=TIMEOUT)):
        for rule, names in want.items():
            assert got["ours"][rule] == names, f"rank {rank}: {rule} differs from one process"
            assert got["ours"][rule] == got["fsdp2"][rule], f"rank {rank}: {rule} differs from FSDP2"
        assert got["ours"]["ndim_kept"] == got["all"], \
            f"rank {rank}: dimensions lost for {sorted(got['all'] - got['ours']['ndim_kept'])}"


@pytest.mark.parametrize("world", [2, 3])
def test_nanogpt_weight_decay_trains_like_one_process(world):
    """AdamW with nanoGPT's groups built from ``p.dim()`` after
    ``fully_shard`` (no ``param_info``): the same losses and parameters as
    one process on the global batch, where the rule sees full shapes. Under
    ``"flat"`` the decay group would be empty and the parameters would
    differ (checked: the same run with ``_original_ndim`` groups is in
    ``test_parity``)."""
    results = run_distributed(world, train_sharded, "blocks+root", "adamw-nanogpt", 3,
                              timeout=TIMEOUT)
    assert_parity(results, train_reference(world, "adamw-nanogpt", 3), atol=1e-5)


# ------------------------------------------------------- empty param groups
def empty_group_resume_worker() -> dict:
    """A group left empty by its rule: warned about once at the first step
    (rank 0), and a ``set_optimizer_state_dict`` resume steps (torch drops
    the empty group's hyperparameters; AdamW used to raise KeyError)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

    def build():
        params = list(model.parameters())
        return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 3],
                                   "weight_decay": 0.1},
                                  {"params": [p for p in params if p.dim() < 3],
                                   "weight_decay": 0.0}], lr=1e-2)

    def step(optim, i):
        tokens, targets = synthetic_tokens(i, 2 * world, 16, GPTConfig().vocab_size)
        mine = slice(2 * rank, 2 * rank + 2)
        model.loss(tokens[mine], targets[mine]).backward()
        optim.step()
        optim.zero_grad()

    optim = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(optim, 0)
        step(optim, 1)
    messages = [str(w.message) for w in caught if "empty parameter group" in str(w.message)]
    saved = copy.deepcopy(get_optimizer_state_dict(model, optim))
    resumed = build()
    set_optimizer_state_dict(model, resumed, saved)
    step(resumed, 2)
    return {"messages": messages, "steps": resumed.state[next(iter(resumed.state))]["step"].item()}


def test_empty_group_is_named_and_resume_steps():
    results = run_distributed(2, empty_group_resume_worker, timeout=TIMEOUT)
    assert len(results[0]["messages"]) == 1, results[0]["messages"]
    assert "group 0 (weight_decay=0.1)" in results[0]["messages"][0]
    assert results[1]["messages"] == []  # rank 0 only
    assert [r["steps"] for r in results] == [3.0, 3.0]


# ------------------------------------------- where rows would pad too much
class _WideRows(torch.nn.Module):
    """A ViT's position embedding: one row of 151,296 elements. Whole rows
    would make every chunk of the unit at least that row (about 3.8 times
    the unit's elements in padding at 3 ranks), next to parameters whose
    rows are cheap."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = torch.nn.Parameter(torch.randn(1, 197, 768))
        self.norm = torch.nn.Parameter(torch.randn(768))
        self.proj = torch.nn.Parameter(torch.randn(64, 768))


def costly_rows_worker(placement) -> dict:
    from fsdp_compose import describe
    model = _WideRows()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fully_shard(model, placement=placement)
    said = [str(w.message) for w in caught if "sharded 'flat'" in str(w.message)]
    report = describe(model).to_dict()
    params = {p["fqn"]: p["placement"] for u in report["units"] for b in u["buffers"]
              for p in b["params"]}
    padding = sum(b["padding"] for u in report["units"] for b in u["buffers"])
    return {"placements": params, "ndim": {n: p.ndim for n, p in model.named_parameters()},
            "padding": padding, "warnings": said}


def test_default_makes_costly_rows_flat_and_describe_names_them():
    """Under the default, the parameters whose whole rows would pad the
    buffer by more than 1% beyond "flat" become "flat" (widest rows first),
    the others keep rows; ``describe()`` names each one's placement. An
    explicit ``"rows"`` keeps rows and pays the padding."""
    default, rows, flat = (run_distributed(3, costly_rows_worker, placement, timeout=TIMEOUT)[0]
                           for placement in (None, "rows", "flat"))
    assert default["placements"] == {"pos": "flat", "norm": "rows", "proj": "rows"}, default
    assert default["ndim"] == {"pos": 1, "norm": 1, "proj": 2}
    numel = 197 * 768 + 768 + 64 * 768
    assert default["padding"] <= flat["padding"] + max(0.01 * numel, 3 * 8), default
    assert len(default["warnings"]) == 1 and "'pos' (1, 197, 768)" in default["warnings"][0]
    assert "'proj'" not in default["warnings"][0] and not rows["warnings"]
    assert rows["placements"] == {"pos": "rows", "norm": "rows", "proj": "rows"}
    assert rows["padding"] > numel  # what the default avoided
