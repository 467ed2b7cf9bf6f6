"""Hybrid sharding x tensor parallelism on a 3-D ``(dp_replicate, dp_shard,
tp)`` mesh: ``parallelize_module(block, mesh["tp"], plan)`` then
``fully_shard(block, mesh=mesh["dp_replicate", "dp_shard"])``.

Parity with one process training on the global batch (SGD-momentum and
AdamW, fp32, 1e-5), collectives counted per mesh dim, clipping over all
three dims, state dicts in torch FSDP2's 3-D placements, DCP round trips and
resharding a checkpoint onto other meshes. The full 2 x 2 x 2 = 8-rank forms
are ``slow`` (8 processes on a 2-core machine); the default run keeps 4-rank
forms ((2, 1, 2): replicas x TP; (1, 2, 2): shards x TP on a 3-D mesh).

The model, plan and reference are ``tests/parallelism/test_tensor_parallel.py``'s.

Run: PYTHONPATH=. python -m pytest -q tests/parallelism/test_hsdp_tp.py   (add -m slow for 8 ranks)
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_compose import fully_shard
from tests.harness import run_distributed
from tests._checkpointing import resume_through_dcp
from tests.parallelism.test_tensor_parallel import (LAYERS, PLAN, _assert_parity, build_model, global_batch,
                                        make_optimizer, train_loop, train_reference)

NAMES = ("dp_replicate", "dp_shard", "tp")
DP = ("dp_replicate", "dp_shard")


def mesh_3d(shape: tuple[int, int, int]):
    return init_device_mesh("cpu", shape, mesh_dim_names=NAMES)


def shard_3d(model, mesh, **kwargs):
    """TP inside each block, then HSDP over the two data-parallel dims."""
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], PLAN)
        fully_shard(block, mesh=mesh[DP], **kwargs)
    fully_shard(model, mesh=mesh[DP], **kwargs)
    return model


def dp_slice(t: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's slice of the global batch: one per (replica, shard)
    coordinate; the tp ranks of one dp coordinate feed the same rows."""
    r, f, _ = mesh.get_coordinate()
    dp_rank, dp_size = r * mesh["dp_shard"].size() + f, mesh[DP].size()
    return t.chunk(dp_size)[dp_rank]


def train_3d(shape, optim_name, steps=3, max_norm=None, count_step=None):
    mesh = mesh_3d(shape)
    model = shard_3d(build_model(), mesh)
    return train_loop(model, mesh, optim_name, lambda t: dp_slice(t, mesh), mesh[DP].size(),
                      steps=steps, max_norm=max_norm, count_step=count_step)


def _dp(shape) -> int:
    return shape[0] * shape[1]


# ------------------------------------------------------------------- parity
def _expected_counts(shape) -> dict:
    """Per step, by (op, mesh dim): FSDP's all-gathers (the blocks, one
    bucket by default, in forward, and each alone in backward, where it is
    the first bucket reached; the root once) and
    reduce-scatters (the bucket's and the root's) over dp_shard (none when
    it has one rank: the buffers alias the shards, nothing is bucketed); one
    gradient all-reduce per unit across dp_replicate; the used flags once
    over each dp dim that has more than one rank; TP's all-reduces over tp
    (as in the 2-D test: 6 per block)."""
    replicas, shards, _ = shape
    units = LAYERS + 1
    want = {("all_reduce", "tp"): 6 * LAYERS}
    if shards > 1:
        want[("_allgather_base_", "dp_shard")] = 2 + LAYERS
        want[("_reduce_scatter_base_", "dp_shard")] = 2
        want[("allreduce_", "dp_shard")] = 1
    if replicas > 1:
        want[("allreduce_", "dp_replicate")] = units + 1
    return want


@pytest.mark.parametrize("shape,optim_name", [((2, 1, 2), "sgd"), ((1, 2, 2), "adamw")],
                         ids=["2x1x2-sgd", "1x2x2-adamw"])
def test_parity_and_collectives_per_mesh_dim(shape, optim_name):
    """Parity over three steps; the third (steady state: the first two add
    rank-divergence checks) has exactly the expected collectives per dim."""
    results = run_distributed(4, train_3d, shape, optim_name, count_step=2, timeout=120)
    _assert_parity(results, train_reference(optim_name, dp=_dp(shape)))
    for res in results:
        assert res["counts"] == _expected_counts(shape), res["counts"]


@pytest.mark.slow
@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_parity_with_one_process_on_8_ranks(optim_name):
    results = run_distributed(8, train_3d, (2, 2, 2), optim_name, timeout=300)
    _assert_parity(results, train_reference(optim_name, dp=4))


@pytest.mark.slow
def test_collectives_per_dim_on_8_ranks():
    results = run_distributed(8, train_3d, (2, 2, 2), "sgd", steps=3, count_step=2, timeout=300)
    for res in results:
        assert res["counts"] == _expected_counts((2, 2, 2)), res["counts"]


@pytest.mark.parametrize("shape", [(2, 1, 2), pytest.param((2, 2, 2), marks=pytest.mark.slow)],
                         ids=["2x1x2", "2x2x2"])
def test_clipping_matches_one_process(shape):
    """Every step clips (max_norm below the norm): TP-sharded pieces summed
    over dp_shard and tp, replicas counted once."""
    world = shape[0] * shape[1] * shape[2]
    results = run_distributed(world, train_3d, shape, "sgd", steps=2, max_norm=0.5,
                              timeout=300)
    reference = train_reference("sgd", steps=2, max_norm=0.5, dp=_dp(shape))
    assert all(n > 0.5 for n in reference["norms"]), reference["norms"]
    _assert_parity(results, reference)


# --------------------------------------------------------------- checkpoint
def _placements_3d(shape):
    mesh = mesh_3d(shape)
    model = shard_3d(build_model(), mesh)
    sd = model.state_dict()
    reference = build_model().state_dict()
    exact = all(torch.equal(sd[k].full_tensor(), v) for k, v in reference.items())
    return {"exact": exact,
            "meshes": {k: tuple(v.device_mesh.mesh_dim_names) for k, v in sd.items()},
            "placements": {k: tuple(v.placements) for k, v in sd.items()}}


@pytest.mark.parametrize("shape", [(1, 2, 2), pytest.param((2, 2, 2), marks=pytest.mark.slow)],
                         ids=["1x2x2", "2x2x2"])
def test_state_dict_uses_fsdp2_3d_placements(shape):
    world = shape[0] * shape[1] * shape[2]
    for res in run_distributed(world, _placements_3d, shape, timeout=300):
        assert res["exact"]
        p, m = res["placements"], res["meshes"]
        strided = _StridedShard(0, split_factor=2)
        assert p["blocks.0.q.weight"] == (Replicate(), strided, Shard(0)), p
        assert p["blocks.0.q.bias"] == (Replicate(), strided, Shard(0)), p
        assert p["blocks.0.o.weight"] == (Replicate(), Shard(0), Shard(1)), p
        assert p["blocks.0.o.bias"] == (Replicate(), Shard(0), Replicate()), p
        assert m["blocks.0.q.weight"] == NAMES
        assert p["blocks.0.norm1.weight"] == (Replicate(), Shard(0)), p
        assert m["blocks.0.norm1.weight"] == DP


def _step(model, optim, i, mesh):
    x, y = global_batch(i, mesh[DP].size())
    model.loss(dp_slice(x, mesh), dp_slice(y, mesh)).backward()
    optim.step()
    optim.zero_grad()


def _scrambled(seed: int):
    """The test model with other values (what a load must overwrite)."""
    model = build_model()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def _save_then_resume(shape, root):
    """Train two steps on ``shape``, save through DCP, resume a scrambled
    copy on the same mesh, then both train two more steps."""
    mesh = mesh_3d(shape)

    def build(seed):
        model = shard_3d(_scrambled(seed) if seed else build_model(), mesh)
        return model, make_optimizer(model, "adamw")

    model, fresh, osd = resume_through_dcp(build, functools.partial(_step, mesh=mesh), root)
    placements = tuple(osd["state"]["blocks.0.q.weight"]["exp_avg"].placements)
    a = {k: v.full_tensor() for k, v in model.state_dict().items()}
    b = {k: v.full_tensor() for k, v in fresh.state_dict().items()}
    return {"diff": max((a[k] - b[k]).abs().max().item() for k in a), "placements": placements}


@pytest.mark.parametrize("shape", [(2, 1, 2), pytest.param((2, 2, 2), marks=pytest.mark.slow)],
                         ids=["2x1x2", "2x2x2"])
def test_dcp_round_trip_continues_identically(shape, tmp_path):
    world = shape[0] * shape[1] * shape[2]
    for res in run_distributed(world, _save_then_resume, shape, str(tmp_path / "ckpt"),
                               timeout=300):
        assert res["diff"] == 0.0, res
        assert res["placements"][0] == Replicate() and res["placements"][-1] == Shard(0), res


def _save(shape, root):
    """Two AdamW steps on ``shape``; save model and optimizer through DCP;
    return the full parameters and the full exp_avg of every parameter."""
    mesh = mesh_3d(shape)
    model = shard_3d(build_model(), mesh)
    optim = make_optimizer(model, "adamw")
    for i in range(2):
        _step(model, optim, i, mesh)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root)
    return _full(model, optim)


def _full(model, optim):
    msd, osd = get_state_dict(model, optim)
    params = {k: _gathered(v) for k, v in msd.items()}
    exp_avg = {k: _gathered(s["exp_avg"]) for k, s in osd["state"].items()}
    return {"params": params, "exp_avg": exp_avg}


def _gathered(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _load(target, root):
    """Load the checkpoint into a scrambled model on ``target``: a 3-D shape
    (HSDP x TP) or ``"fsdp"`` (a 1-D mesh over every rank, no TP)."""
    if target == "fsdp":
        model = _scrambled(7)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = make_optimizer(model, "adamw")
        x, y = global_batch(0, dist.get_world_size())
        r, w = dist.get_rank(), dist.get_world_size()
        model.loss(x.chunk(w)[r], y.chunk(w)[r]).backward()
    else:
        mesh = mesh_3d(target)
        model = shard_3d(_scrambled(7), mesh)
        optim = make_optimizer(model, "adamw")
        x, y = global_batch(0, mesh[DP].size())
        model.loss(dp_slice(x, mesh), dp_slice(y, mesh)).backward()
    optim.step()  # optimizer state to overwrite
    optim.zero_grad()
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=root)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full(model, optim)


def _assert_same_state(got, want):
    for kind in ("params", "exp_avg"):
        assert got[kind].keys() == want[kind].keys(), kind
        for name, value in want[kind].items():
            assert torch.equal(got[kind][name], value), f"{kind} {name}"


def _reshard_checkpoint(save_shape, targets, tmp_path):
    root = str(tmp_path / "ckpt")
    world = save_shape[0] * save_shape[1] * save_shape[2]
    saved = run_distributed(world, _save, save_shape, root, timeout=300)[0]
    for target in targets:
        for got in run_distributed(world, _load, target, root, timeout=300):
            _assert_same_state(got, saved)


def test_checkpoint_saved_on_2x1x2_loads_on_1x2x2_and_on_1d_fsdp(tmp_path):
    _reshard_checkpoint((2, 1, 2), [(1, 2, 2), "fsdp"], tmp_path)


@pytest.mark.slow
def test_checkpoint_saved_on_2x2x2_loads_on_1x4x2_and_on_1d_fsdp(tmp_path):
    _reshard_checkpoint((2, 2, 2), [(1, 4, 2), "fsdp"], tmp_path)


# -------------------------------------------------------------- param_norms
def _param_norms(shape):
    from fsdp_compose.gradients.clip import param_norms
    mesh = mesh_3d(shape)
    model = shard_3d(build_model(), mesh)
    x, y = global_batch(0, mesh[DP].size())
    model.loss(dp_slice(x, mesh), dp_slice(y, mesh)).backward()
    return {kind: {k: v.item() for k, v in param_norms(model, kind).items()}
            for kind in ("grad", "weight")}


@pytest.mark.parametrize("shape", [(1, 2, 2), pytest.param((2, 2, 2), marks=pytest.mark.slow)],
                         ids=["1x2x2", "2x2x2"])
def test_param_norms_match_one_process(shape):
    """Each original parameter's norm (gradient and weight): TP-sharded
    pieces summed over dp_shard and tp, TP-replicated ones and replicas once."""
    world = shape[0] * shape[1] * shape[2]
    reference = build_model()
    x, y = global_batch(0, _dp(shape))
    reference.loss(x, y).backward()
    want = {"grad": {n: p.grad.norm().item() for n, p in reference.named_parameters()},
            "weight": {n: p.detach().norm().item() for n, p in reference.named_parameters()}}
    for got in run_distributed(world, _param_norms, shape, timeout=300):
        for kind in ("grad", "weight"):
            assert got[kind].keys() == want[kind].keys()
            for name, value in want[kind].items():
                assert got[kind][name] == pytest.approx(value, rel=1e-5, abs=1e-7), \
                    (kind, name, got[kind][name], value)
