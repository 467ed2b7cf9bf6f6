"""FSDP2's SPMD mode on 4 CPU ranks: ``fully_shard(module,
mesh=spmd_mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))`` where
every parameter is a ``DTensor`` on the whole ``(dp, tp)`` mesh,
``Replicate()`` on ``dp`` and Colwise / Rowwise / replicated on ``tp``, and
forward runs on ``DTensor`` inputs ``(Shard(0), Replicate())``. Parity with
one process training on the global batch, the same losses as torch FSDP2 in
that mode step by step, and what is refused.

Run: PYTHONPATH=. python -m pytest -q tests/parallelism/test_spmd_mesh.py
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdp_compose import fully_shard
from tests._models import assert_dicts_close, global_mean, make_optim
from tests.harness import run_distributed

try:  # torch >= 2.13
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:
    DataParallelMeshDims = None

DIM, HIDDEN, OUT, BLOCKS = 6, 10, 3, 2
PER_DP_RANK, STEPS, DP, TP = 3, 3, 2, 2
SEED = 11


@dataclass
class _Dims:
    """What fsdp_compose reads of ``dp_mesh_dims`` (torch's class is newer than 2.11)."""

    shard: Optional[str] = None
    replicate: Optional[str] = None


def dp_dims(shard: str = "dp"):
    return DataParallelMeshDims(shard=shard) if DataParallelMeshDims is not None else _Dims(shard)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build() -> Model:
    torch.manual_seed(SEED)
    return Model()


TP_PLACEMENT = {"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1)}
"""Colwise ``up``, Rowwise ``down`` on tp; everything else replicated."""


def distribute(model: nn.Module, mesh) -> None:
    """Every parameter a DTensor on the whole (dp, tp) mesh."""
    for prefix, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            key = f"{prefix.rsplit('.', 1)[-1]}.{name}"
            placements = [Replicate(), TP_PLACEMENT.get(key, Replicate())]
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(DP * PER_DP_RANK, DIM, generator=g), torch.randn(DP * PER_DP_RANK, OUT,
                                                                        generator=g)


def _spmd_loss(model: nn.Module, mesh, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """This dp rank's rows in, its own mean loss out (its tp ranks feed the same rows)."""
    rows = slice(mesh.get_coordinate()[0] * PER_DP_RANK, (mesh.get_coordinate()[0] + 1) * PER_DP_RANK)
    inputs = DTensor.from_local(x[rows], mesh, [Shard(0), Replicate()], run_check=False)
    out = model(inputs).redistribute(placements=[Shard(0), Replicate()]).to_local()
    return F.mse_loss(out, y[rows])


def _train_spmd(impl: str, optim_name: str) -> dict:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = build()
    distribute(model, mesh)
    # FSDP2 wants the very mesh object its parameters hold, and in a process
    # that built an equal mesh before, distribute_tensor hands out that one
    mesh = next(model.parameters()).device_mesh
    if impl == "fsdp_compose":
        shard = fully_shard
    else:
        from torch.distributed.fsdp import fully_shard as shard
    for block in model.blocks:
        shard(block, mesh=mesh, dp_mesh_dims=dp_dims())
    shard(model, mesh=mesh, dp_mesh_dims=dp_dims())
    optim = make_optim(model.parameters(), optim_name)
    losses = []
    for step in range(STEPS):
        loss = _spmd_loss(model, mesh, *batch(step))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss))
    params = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params}


def _train_reference(optim_name: str) -> dict:
    model = build()
    optim = make_optim(model.parameters(), optim_name)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@functools.cache
def _spmd_run(impl: str, optim_name: str) -> list[dict]:
    """``_train_spmd`` on every rank, once per configuration: the parity test
    and the comparison with FSDP2 read the same AdamW run (callers only read
    the results)."""
    return run_distributed(DP * TP, _train_spmd, impl, optim_name, timeout=120)


@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_dp_mesh_dims_matches_one_process(optim_name):
    reference = _train_reference(optim_name)
    for rank, res in enumerate(_spmd_run("fsdp_compose", optim_name)):
        for i, (got, want) in enumerate(zip(res["losses"], reference["losses"])):
            assert abs(got - want) <= 1e-5, f"rank {rank}: loss of step {i} {got} vs {want}"
        assert_dicts_close(res["params"], reference["params"], 1e-5, f"rank {rank}: ")


@pytest.mark.skipif(DataParallelMeshDims is None, reason="torch FSDP2 has dp_mesh_dims from 2.13")
def test_dp_mesh_dims_same_losses_as_fsdp2():
    ours = _spmd_run("fsdp_compose", "adamw")
    theirs = run_distributed(DP * TP, _train_spmd, "fsdp2", "adamw", timeout=120)
    for got, want in zip(ours, theirs):
        assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) <= 1e-6, (got, want)


def _refused(case: str) -> str:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = build()
    try:
        if case == "plain-parameter":
            fully_shard(model.blocks[0], mesh=mesh, dp_mesh_dims=dp_dims())
        elif case == "sharded-on-dp":
            block = model.blocks[0]
            block.up.weight = nn.Parameter(distribute_tensor(
                block.up.weight.detach(), mesh, [Shard(0), Replicate()], src_data_rank=None))
            fully_shard(block.up, mesh=mesh, ignored_params={block.up.bias},
                        dp_mesh_dims=dp_dims())
        elif case == "unknown-dim":
            distribute(model, mesh)
            fully_shard(model.blocks[0], mesh=mesh, dp_mesh_dims=dp_dims("data"))
    except (ValueError, NotImplementedError) as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("case,words", [
    ("plain-parameter", "'up.weight' is a plain tensor, but fully_shard got dp_mesh_dims"),
    ("sharded-on-dp", "must be Replicate()"),
    ("unknown-dim", "not dims of the mesh")])
def test_dp_mesh_dims_misuse_raises_on_every_rank(case, words):
    for message in run_distributed(DP * TP, _refused, case, timeout=60):
        assert words in message, message
