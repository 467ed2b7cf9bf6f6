"""The advice every one-rank ``state_dict()`` message ends with
(``SAVE_ADVICE`` in ``fsdp_compose/checkpoint/_lazy.py``), and the one of a
one-rank ``optimizer.state_dict()`` (``OPTIM_SAVE_ADVICE`` in
``checkpoint/_optim.py``), run as written: their code, taken from the
messages themselves, is executed on 3 ranks, and the files it writes hold
what one process trained on the global batch holds.

Run: ``PYTHONPATH=. python -m pytest -q tests/checkpoint/test_save_advice.py``
(gloo on CPU, 3 ranks).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
import torch.distributed.checkpoint
import torch.nn as nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict)

from fsdp_compose import fully_shard
from fsdp_compose.checkpoint._lazy import SAVE_ADVICE
from fsdp_compose.checkpoint._optim import OPTIM_SAVE_ADVICE

WORLD = 3


def _snippets(advice: str = SAVE_ADVICE) -> list[str]:
    """The code of the advice: what it puts between backticks."""
    return re.findall(r"`([^`]+)`", advice)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 15), nn.Tanh(), nn.Linear(15, 5))  # uneven over 3 ranks


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(6, 7), torch.randn(6, 5)


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.optim.Optimizer:
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        optim.zero_grad()
    return optim


def _run_the_advice(directory: str) -> None:
    """Every rank trains its part of the global batch, then runs the
    advice's code as written."""
    rank = dist.get_rank()
    model = _net()
    fully_shard(model[0])
    fully_shard(model)
    x, y = _batch()
    _step(model, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
    namespace = {"model": model, "rank": rank, "torch": torch, "f": f"{directory}/full.pt",
                 "path": f"{directory}/sharded", "get_model_state_dict": get_model_state_dict,
                 "StateDictOptions": StateDictOptions}
    for code in _snippets():
        exec(code, namespace)
    dist.barrier()


def test_the_advice_names_the_calls():
    assert _snippets() == [
        "sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, "
        "cpu_offload=True))",
        "if rank == 0: torch.save(sd, f)",
        "torch.distributed.checkpoint.save({'model': model.state_dict()}, checkpoint_id=path)"]


def test_the_advice_runs_and_its_files_load_into_one_process(distributed, tmp_path):
    distributed.run(WORLD, _run_the_advice, str(tmp_path), timeout=180)
    reference = _net()
    _step(reference, *_batch())
    expected = reference.state_dict()

    full = _net()
    full.load_state_dict(torch.load(tmp_path / "full.pt"))
    dcp_to_torch_save(tmp_path / "sharded", tmp_path / "from_dcp.pt")
    sharded = _net()
    sharded.load_state_dict(torch.load(tmp_path / "from_dcp.pt")["model"])
    for name, value in expected.items():
        torch.testing.assert_close(full.state_dict()[name], value, msg=name)
        torch.testing.assert_close(sharded.state_dict()[name], value, msg=name)
    assert not torch.equal(expected["0.weight"], _net().state_dict()["0.weight"])  # it trained


def _run_the_optimizer_advice(directory: str) -> None:
    """Every rank trains its part of the global batch, then runs the
    optimizer message's code as written."""
    rank = dist.get_rank()
    model = _net()
    fully_shard(model[0])
    fully_shard(model)
    x, y = _batch()
    optim = _step(model, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
    namespace = {"model": model, "optim": optim, "rank": rank, "torch": torch,
                 "f": f"{directory}/optim.pt", "path": f"{directory}/optim_sharded",
                 "get_optimizer_state_dict": get_optimizer_state_dict,
                 "StateDictOptions": StateDictOptions}
    for code in _snippets(OPTIM_SAVE_ADVICE):
        exec(code, namespace)
    dist.barrier()


def test_the_optimizer_advice_names_the_calls():
    assert _snippets(OPTIM_SAVE_ADVICE) == [
        "osd = get_optimizer_state_dict(model, optim, options=StateDictOptions("
        "full_state_dict=True, cpu_offload=True))",
        "if rank == 0: torch.save(osd, f)",
        "torch.distributed.checkpoint.save({'optim': get_optimizer_state_dict(model, optim)}, "
        "checkpoint_id=path)"]


def test_the_optimizer_advice_runs_and_its_files_hold_one_process_state(distributed, tmp_path):
    distributed.run(WORLD, _run_the_optimizer_advice, str(tmp_path), timeout=180)
    reference = _net()
    optim = _step(reference, *_batch())
    expected = {name: optim.state[param]["momentum_buffer"]
                for name, param in reference.named_parameters()}

    full = torch.load(tmp_path / "optim.pt")["state"]
    dcp_to_torch_save(tmp_path / "optim_sharded", tmp_path / "optim_from_dcp.pt")
    sharded = torch.load(tmp_path / "optim_from_dcp.pt")["optim"]["state"]
    for name, value in expected.items():
        torch.testing.assert_close(full[name]["momentum_buffer"], value, msg=name)
        torch.testing.assert_close(sharded[name]["momentum_buffer"], value, msg=name)
    assert all(value.abs().sum() > 0 for value in expected.values())  # it trained
