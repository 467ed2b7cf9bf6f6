"""The forgotten root: parameters the optimizer updates but no unit
manages are named in one warning on rank 0 at the first step
(``fsdp_compose/checks/unmanaged.py``).

Run: ``PYTHONPATH=. python -m pytest -q tests/test_unmanaged.py`` (gloo, 2 ranks).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import fsdp_compose
from fsdp_compose import fully_shard
from fsdp_compose.testing import GPT, GPTConfig
from tests.harness import run_distributed


def _train(how: str):
    """Two steps of a small GPT annotated per ``how``; returns the warnings
    fsdp_compose gave on this rank and the largest difference between the
    ranks' copies of the token embedding after the steps."""
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    for block in model.blocks:
        fully_shard(block)
    if how == "root":
        fully_shard(model)
    elif how == "ddp":
        from torch.distributed._composable import replicate
        replicate(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if how == "marked":
        fsdp_compose.mark_reduced_elsewhere(p for p in model.parameters()
                                            if fsdp_compose.param_info(p) is None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            tokens = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(
                10 * step + dist.get_rank()))
            model.loss(tokens, tokens).backward()
            optim.step()
            optim.zero_grad()
    ours = [str(w.message) for w in caught if "no fully_shard unit manages" in str(w.message)]
    if how == "root":
        return ours, 0.0
    weight = model.tok_emb.weight.detach().clone()
    every = [torch.empty_like(weight) for _ in range(dist.get_world_size())]
    dist.all_gather(every, weight)
    return ours, max((e - every[0]).abs().max().item() for e in every)


def test_a_forgotten_root_warns_once_on_rank_zero_naming_the_parameters():
    (first, drift), (second, _) = run_distributed(2, _train, "blocks-only", timeout=90)
    assert len(first) == 1 and second == [], (first, second)
    assert drift > 0  # what the warning is about: the copies drift apart
    assert "'tok_emb.weight'" in first[0] and "usually the root" in first[0], first[0]
    assert "mark_reduced_elsewhere" in first[0]


@pytest.mark.parametrize("how", ["root", "marked", "ddp"])
def test_no_warning_where_every_parameter_is_reduced(how):
    for warned, _ in run_distributed(2, _train, how, timeout=90):
        assert warned == [], warned
