"""Rank-dependent control flow: divergence raises on every rank (never a
hang, never silently mixed values), and ``set_reduce_scatter_unused_params``
makes rank-dependent *backward* use correct.

Run: ``PYTHONPATH=. python -m pytest -q tests/checks/test_rank_divergence.py``
(gloo on CPU; each world uses its own process group with a 20 s collective
timeout, so a missed check shows as an error, not the harness's 60 s hang).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_compose import fully_shard
from fsdp_compose.checks.divergence import CHECK_ENV
from fsdp_compose.policies import PrefetchPolicy
from tests._comm_counter import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CollectiveCounter
from tests._models import WithUnused
from tests._training import make_optimizer
from tests.harness import run_distributed

TIMEOUT = 60
BATCH_PER_RANK = 3


class Branchy(nn.Module):
    """Three same-size blocks (so mismatched all-gathers would pair silently),
    an auxiliary head whose output may reach the loss on some ranks only, and
    a head no rank ever runs. Uneven shapes (7 -> 15) exercise padding."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 15)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(15, 15), nn.Tanh()) for _ in range(3))
        self.aux = WithUnused(15, 5, 2)  # a head with a parameter its forward never uses
        self.never = nn.Linear(15, 3)
        self.out = nn.Linear(15, 4)

    def forward(self, x: torch.Tensor, order=(0, 1, 2)):
        h = self.inp(x)
        for i in order:
            h = self.blocks[i](h)
        return self.out(h), self.aux(h)


def _build(group=None, mode: str = "off") -> nn.Module:
    torch.manual_seed(0)
    model = Branchy()
    if group is None:
        return model
    mesh = DeviceMesh.from_group(group, "cpu")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.aux, mesh=mesh)
    fully_shard(model.never, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if mode == "aux":
        model.aux.set_reduce_scatter_unused_params(True, recurse=False)
        model.never.set_reduce_scatter_unused_params(True, recurse=False)
    elif mode == "all":
        model.set_reduce_scatter_unused_params(True)
    return model


def _batch(step: int, world: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(world * BATCH_PER_RANK, 7, generator=g)
    y = torch.randn(world * BATCH_PER_RANK, 4, generator=g)
    return x, y


def _rank_loss(model, x, y, rank: int, aux_ranks, order=(0, 1, 2)) -> torch.Tensor:
    """This rank's loss: the aux head's output reaches it on ``aux_ranks`` only."""
    out, aux = model(x, order)
    loss = (out - y).pow(2).mean()
    if rank in aux_ranks:
        loss = loss + 0.3 * aux.pow(2).mean()
    return loss


def _group():
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=20))


def _train_until_error(scenario: str):
    """Runs on every rank: train a few steps where ``scenario`` makes the
    ranks diverge at some step; returns (step, seconds, message) of the
    error, or None if every step ran."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = _group()
    model = _build(group)
    if scenario == "skip-step3-checked":
        model.set_check_rank_divergence(True)
    if scenario == "order-step3":
        # without forward prefetch, swapping two same-size units keeps the
        # number and sizes of the collectives equal: values would mix silently
        model.set_prefetch_policy(PrefetchPolicy(forward=False))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    result = None
    for step in range(5):
        x, y = _batch(step, world)
        x, y = x[rank::world], y[rank::world]
        order, aux_ranks = (0, 1, 2), range(world)
        if rank == 1 and scenario == "skip-step0":
            order = (0, 2) if step == 0 else order
        elif rank == 1 and scenario == "order-step0" and step == 0:
            order = (0, 2, 1)
        elif rank == 1 and scenario == "order-step3" and step == 3:
            order = (0, 2, 1)
        elif rank == 1 and scenario in ("skip-step3-checked", "skip-step3-env") and step == 3:
            order = (0, 2)
        elif scenario == "aux-some-ranks":
            aux_ranks = (0,)
        start = time.perf_counter()
        try:
            _rank_loss(model, x, y, rank, aux_ranks, order).backward()
        except RuntimeError as error:
            result = (step, time.perf_counter() - start, str(error))
            break
        optim.step()
        optim.zero_grad()
    dist.barrier(group)
    dist.destroy_process_group(group)
    return result


@pytest.mark.parametrize("scenario,step,names", [
    # a unit skipped on one rank in the first iteration
    ("skip-step0", 0, ["'blocks.1'", "'blocks.2'", "in forward"]),
    # two units in different orders on two ranks
    ("order-step0", 0, ["'blocks.1'", "'blocks.2'", "in forward"]),
    # after the verification iterations: same-size units swapped on one rank
    # (same number of collectives, values would mix): the agreement at the
    # end of every training forward
    ("order-step3", 3, ["'blocks.1'", "'blocks.2'", "at the end of the forward"]),
    # a unit skipped after the verification iterations, with the check on
    # (forward prefetch gathers the skipped unit anyway; the forward orders differ)
    ("skip-step3-checked", 3, ["'blocks.1'", "'blocks.2'", "comparing forward orders"]),
    # backward-only divergence without the opt-in mode
    ("aux-some-ranks", 0, ["'aux'", "set_reduce_scatter_unused_params(True)"]),
])
def test_divergence_raises_on_every_rank(scenario, step, names):
    results = run_distributed(2, _train_until_error, scenario, timeout=TIMEOUT)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} trained through the divergence"
        got_step, seconds, message = result
        assert got_step == step, f"rank {rank}: raised at step {got_step}: {message}"
        assert seconds < 10, f"rank {rank} took {seconds:.1f} s to raise"
        assert "ranks diverged" in message and f"[rank {rank}]" in message
        for name in names:
            assert name in message, f"rank {rank}: {name!r} not in:\n{message}"
    if scenario.startswith("skip") or scenario.startswith("order"):
        assert "cannot fix forward-side divergence" in results[0][2]


def _env_check():
    """With FSDP_COMPOSE_CHECK_ORDER=1 a skip in iteration 3 raises at once."""
    os.environ[CHECK_ENV] = "1"
    try:
        return _train_until_error("skip-step3-env")
    finally:
        del os.environ[CHECK_ENV]


def test_environment_variable_turns_the_check_on():
    for result in run_distributed(2, _env_check, timeout=TIMEOUT):
        assert result is not None and result[0] == 3 and "'blocks.2'" in result[2]


# ---------------------------------------------------------- collective counts
def _count_per_iteration(checked):
    rank, world = dist.get_rank(), dist.get_world_size()
    group = _group()
    model = _build(group)
    model.set_bucket_cap_mb(0)  # the per-unit structure (tests/runtime/test_bucketing.py counts buckets)
    if checked is not None:
        model.set_check_rank_divergence(checked)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    counts = []
    for step in range(4):
        x, y = _batch(step, world)
        with CollectiveCounter() as comm:
            _rank_loss(model, x[rank::world], y[rank::world], rank, range(world)).backward()
        optim.step()
        optim.zero_grad()
        counts.append({"ag": comm.counts[ALL_GATHER], "rs": comm.counts[REDUCE_SCATTER],
                       "ar": comm.counts[ALL_REDUCE],
                       "other": sum(comm.counts.values()) - comm.counts[ALL_GATHER]
                       - comm.counts[REDUCE_SCATTER] - comm.counts[ALL_REDUCE]})
    dist.destroy_process_group(group)
    return counts


@pytest.mark.parametrize("checked", [None, True, False])
def test_extra_collectives_only_in_verification_iterations(checked):
    counts = run_distributed(2, _count_per_iteration, checked, timeout=TIMEOUT)[0]
    # 6 units (root, 3 blocks, aux, never) of one buffer each; `never` is not run:
    # 5 forward + 4 backward all-gathers, 5 reduce-scatters, 1 flags all-reduce
    steady = {"ag": 9, "rs": 5, "ar": 1, "other": 0}
    # a verified iteration adds one tiny all-gather per data collective and
    # one before the flags all-reduce
    # one after the root's forward (its order) and one before the flags all-reduce
    verified = dict(steady, ag=steady["ag"] * 2 + steady["rs"] + 2)
    expected = {None: [verified, verified, steady, steady], True: [verified] * 4,
                False: [steady] * 4}[checked]
    # at lazy init: the layout check and the forward agreement's model number
    expected[0] = dict(expected[0], ag=expected[0]["ag"] + 2)
    assert counts == expected


# ------------------------------------------------ set_reduce_scatter_unused_params
def _train_mode_sharded(mode: str, optim_name: str, steps: int, aux_ranks):
    rank, world = dist.get_rank(), dist.get_world_size()
    group = _group()
    model = _build(group, mode)
    optim = make_optimizer(model, optim_name)
    losses, grads_none = [], []
    for step in range(steps):
        x, y = _batch(step, world)
        loss = _rank_loss(model, x[rank::world], y[rank::world], rank, aux_ranks)
        loss.backward()
        grads_none.append({n: p.grad is None for n, p in model.named_parameters()})
        optim.step()
        optim.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=group)
        losses.append(loss.item())
    model.unshard(recurse=True)
    params = {n: p.detach().clone() for n, p in _full_params(model).items()}
    model.reshard(recurse=True)
    dist.destroy_process_group(group)
    return {"losses": losses, "params": params, "grads_none": grads_none}


def _full_params(model: nn.Module) -> dict:
    names = [n for n, _ in model.named_parameters()]
    out = {}
    for name in names:
        owner, _, attr = name.rpartition(".")
        out[name] = getattr(model.get_submodule(owner) if owner else model, attr)
    return out


def _train_mode_reference(world: int, optim_name: str, steps: int, aux_ranks) -> dict:
    """One process on the global batch: the mean of every rank's loss."""
    model = _build()
    optim = make_optimizer(model, optim_name)
    losses, grads_none = [], []
    for step in range(steps):
        x, y = _batch(step, world)
        loss = sum(_rank_loss(model, x[r::world], y[r::world], r, aux_ranks)
                   for r in range(world)) / world
        loss.backward()
        grads_none.append({n: p.grad is None for n, p in model.named_parameters()})
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone()
                                         for n, p in model.named_parameters()},
            "grads_none": grads_none}


@pytest.mark.parametrize("mode,optim_name", [("aux", "sgd"), ("aux", "adamw"), ("all", "adamw")])
def test_reduce_scatter_unused_params_parity(mode, optim_name):
    world, steps, aux_ranks = 3, 4, (0,)
    results = run_distributed(world, _train_mode_sharded, mode, optim_name, steps, aux_ranks,
                              timeout=TIMEOUT)
    reference = _train_mode_reference(world, optim_name, steps, aux_ranks)
    # parameters no rank used keep .grad None, as in one process
    assert reference["grads_none"][0]["aux.unused.weight"]
    assert reference["grads_none"][0]["never.weight"]
    assert not reference["grads_none"][0]["aux.used.weight"]
    for rank, res in enumerate(results):
        assert res["grads_none"] == reference["grads_none"], f"rank {rank}"
        for got, want in zip(res["losses"], reference["losses"]):
            assert abs(got - want) <= 1e-5, f"rank {rank}: loss {got} vs {want}"
        for name, want in reference["params"].items():
            diff = (res["params"][name] - want).abs().max().item()
            assert diff <= 1e-5, f"rank {rank}: {name} differs by {diff}"
