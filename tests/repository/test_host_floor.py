"""The ``floor`` variant of ``benchmarks/host_cost/proxy.py`` (``benchmarks/host_cost/floor.py``)
trains exactly as the unsharded model does: its step time is a floor of
the design's host cost only if it does the same arithmetic.

Run: ``.venv/bin/python -m pytest -q tests/repository/test_host_floor.py``
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.host_cost.floor import floor_units
from fsdp_compose.testing import GPT, GPTConfig, synthetic_tokens, train_losses


def _losses(floor: bool, steps: int = 3, checked: bool = False) -> list[float]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=3))
    if floor:
        units = floor_units(model, model.blocks, checked=checked)
        assert len(units) == 4 and sum(len(u.params) for u in units) == \
            len(list(model.parameters()))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return train_losses(model, optim, (synthetic_tokens(step, 2, 8, 64) for step in range(steps)))


@pytest.mark.parametrize("checked", [False, True], ids=["floor", "floor_checked"])
def test_floor_trains_as_the_unsharded_model(checked: bool) -> None:
    reference, floor = _losses(floor=False), _losses(floor=True, checked=checked)
    assert floor == reference  # same kernels on the same values: bitwise
    assert reference[0] != reference[-1]  # the steps changed the parameters


def test_checked_floor_makes_the_checks() -> None:
    """The checked floor's checks are live: a parameter registered after
    the units were made is refused at the next forward."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=1))
    floor_units(model, model.blocks, checked=True)
    model.blocks[0].register_parameter("late", torch.nn.Parameter(torch.zeros(2)))
    tokens, targets = synthetic_tokens(0, 2, 8, 64)
    with pytest.raises(RuntimeError, match="late"):
        model.loss(tokens, targets)
