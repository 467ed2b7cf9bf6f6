"""Mixture of experts with expert parallelism on 4 CPU ranks.

The meshes are carved from one world mesh, as torchtitan does: the dense
layers are sharded over all 4 ranks (``dense["fsdp"]``), the routed experts
are ``DTensor`` parameters ``Shard(0)`` over ``sparse["ep"]`` (2 ranks hold
different experts; tokens travel by ``all_to_all_single``) and sharded by
``fully_shard`` over ``sparse["efsdp"]`` (the 2 ranks that hold the same
experts). Parity with one process training the same model on the global
batch, the clipped gradient norm equal on every rank and to the reference,
and the state dict's experts on FSDP2's (efsdp, ep) placements.

Run: PYTHONPATH=. python -m pytest -q tests/parallelism/test_moe.py
"""

from __future__ import annotations

import functools
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_compose import OnMesh, clip_grad_norm_, describe, fully_shard, materialize
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_common
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from tests._comm_counter import ALL_GATHER, REDUCE_SCATTER, CollectiveCounter
from tests._models import assert_dicts_close, global_mean, make_optim
from fsdp_compose.testing.moe import (D, PER_RANK, Experts, TinyMoELM, batch, build_moe,
                                      enable_expert_parallel)
from tests.harness import run_distributed

WORLD, EP = 4, 2
STEPS = 3
MAX_NORM = 0.3  # below the first steps' norms: clipping changes every update
ATOL = 1e-5


def _meshes(world: int):
    world_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("world",))
    dense = world_mesh._unflatten(0, (world,), ("fsdp",))
    sparse = world_mesh._unflatten(0, (world // EP, EP), ("efsdp", "ep"))
    return dense, sparse


LAYOUTS = ["experts-units", "on-mesh"]
"""How the experts meet their mesh: as units of their own annotated over
efsdp, or inside their block's unit through ``shard_placement_fn``
returning ``OnMesh(efsdp)`` (a mesh per parameter)."""
ALL_LAYOUTS = LAYOUTS + ["on-mesh-dim1"]
"""And experts split on dim 1 by efsdp (``OnMesh(efsdp, Shard(1))``), as
recipes do when the data-parallel degree exceeds the number of experts."""


def shard_moe(model: nn.Module, world: int, layout: str = "experts-units") -> nn.Module:
    """The recipe: experts on (efsdp, ep), everything else on fsdp."""
    dense, sparse = _meshes(world)
    enable_expert_parallel(model, sparse["ep"])
    efsdp = sparse["efsdp"]
    for block in model.blocks:
        if layout == "experts-units":
            fully_shard(block.moe.experts, mesh=efsdp)
            fully_shard(block, mesh=dense["fsdp"])
        else:
            on_efsdp = OnMesh(efsdp, Shard(1) if layout.endswith("dim1") else None)
            fully_shard(block, mesh=dense["fsdp"],
                        shard_placement_fn=lambda p: on_efsdp if isinstance(p, DTensor) else None)
    fully_shard(model, mesh=dense["fsdp"])
    # efsdp sums over its 2 ranks, but each expert's gradient sums the tokens
    # of all `world` ranks (ep brought them): divide by world (the mean over
    # all ranks for everything else, as the default)
    model.set_gradient_divide_factor(world)
    return model


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def _train(model: nn.Module, optim_name: str, clip: bool = True) -> dict:
    """``STEPS`` steps of this rank's slice of the global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optim = make_optim(model.parameters(), optim_name)
    losses, norms = [], []
    for step in range(STEPS):
        tokens, targets = batch(step, PER_RANK * world)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss = model.loss(tokens[mine], targets[mine])
        loss.backward()
        if clip:
            norms.append(clip_grad_norm_(model, MAX_NORM).item())
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss))
    return {"losses": losses, "norms": norms}


def _train_sharded(optim_name: str, layout: str) -> dict:
    model = shard_moe(build_moe(), dist.get_world_size(), layout)
    return {**_train(model, optim_name), "params": _full_state(model)}


def _train_reference(optim_name: str, world: int, model: Optional[nn.Module] = None) -> dict:
    model = build_moe() if model is None else model
    optim = make_optim(model.parameters(), optim_name)
    losses, norms = [], []
    for step in range(STEPS):
        tokens, targets = batch(step, PER_RANK * world)
        loss = model.loss(tokens, targets)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@functools.cache
def _reference(optim_name: str, world: int) -> dict:
    """``_train_reference`` from ``build_moe()``, once per configuration
    (callers only read it)."""
    return _train_reference(optim_name, world)


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_expert_parallel_moe_matches_one_process(optim_name, layout):
    results = run_distributed(WORLD, _train_sharded, optim_name, layout, timeout=120)
    _assert_matches(results, _reference(optim_name, WORLD))


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_moe_on_8_ranks(layout):
    """ep 2 x efsdp 4, the dense layers over 8."""
    results = run_distributed(8, _train_sharded, "adamw", layout, timeout=300)
    _assert_matches(results, _reference("adamw", 8))


def _assert_matches(results: list[dict], reference: dict) -> None:
    assert reference["norms"][0] > MAX_NORM  # clipping is exercised
    for rank, res in enumerate(results):
        # the clipped norm is the model's: the same bits on every rank
        assert res["norms"] == results[0]["norms"], (rank, res["norms"], results[0]["norms"])
        for got, want in zip(res["norms"], reference["norms"]):
            assert abs(got - want) <= ATOL * max(1.0, want), (rank, got, want)
        for i, (got, want) in enumerate(zip(res["losses"], reference["losses"])):
            assert abs(got - want) <= ATOL, f"rank {rank}: loss of step {i} {got} vs {want}"
        assert_dicts_close(res["params"], reference["params"], ATOL, f"rank {rank}: ")


def _expert_placements(layout: str) -> dict:
    model = shard_moe(build_moe(), dist.get_world_size(), layout)
    value = model.state_dict()["blocks.0.moe.experts.w1"]
    dense = model.state_dict()["blocks.0.dense.weight"]
    text = str(describe(model))
    return {"described": [line.strip() for line in text.splitlines() if "sharded over ranks" in line],
            "mesh": value.device_mesh.mesh.tolist(), "names": value.device_mesh.mesh_dim_names,
            "placements": tuple(value.placements), "dense": tuple(dense.placements),
            "dense_mesh": dense.device_mesh.mesh.tolist()}


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_expert_state_dict_uses_fsdp2_placements(layout):
    """FSDP2 describes an expert weight sharded on dim 0 by both ep and
    efsdp on the concatenated (efsdp, ep) mesh, efsdp first: its rows are
    split by ep first, so efsdp's placement is ``_StridedShard(0, 2)``."""
    for res in run_distributed(WORLD, _expert_placements, layout, timeout=90):
        assert res["names"] == ("efsdp", "ep")
        assert res["mesh"] == [[0, 1], [2, 3]]
        if layout.endswith("dim1"):  # efsdp splits dim 1, ep dim 0: no interleaving
            assert res["placements"] == (Shard(1), Shard(0))
        else:
            assert res["placements"] == (_StridedShard(0, split_factor=EP), Shard(0))
        assert res["dense"] == (Shard(0),) and res["dense_mesh"] == [0, 1, 2, 3]
        if layout.startswith("on-mesh"):  # describe() names the buffers on efsdp (one per block)
            assert len(res["described"]) == 2, res["described"]
            assert all(line.startswith("sharded over ranks [") for line in res["described"])


def _losses_under(impl: str, layout: str) -> list[float]:
    """The recipe above, unchanged but for which ``fully_shard`` it calls
    (torch FSDP2's or ours) and how ``shard_placement_fn`` names the mesh
    (FSDP2's ``ShardPlacementResult``), with the same meshes and divide
    factor."""
    world = dist.get_world_size()
    if impl == "fsdp_compose":
        return _train(shard_moe(build_moe(), world, layout), "adamw", clip=False)["losses"]
    return _train(shard_moe_with_fsdp2(build_moe(), world, layout), "adamw", clip=False)["losses"]


def shard_moe_with_fsdp2(model: nn.Module, world: int, layout: str) -> nn.Module:
    """:func:`shard_moe` with torch FSDP2's ``fully_shard``."""
    dense, sparse = _meshes(world)
    efsdp = sparse["efsdp"]
    enable_expert_parallel(model, sparse["ep"])
    for block in model.blocks:
        if layout == "experts-units":
            torch_fully_shard(block.moe.experts, mesh=efsdp)
            torch_fully_shard(block, mesh=dense["fsdp"])
        else:
            on_efsdp = _fsdp_common.ShardPlacementResult(
                Shard(1 if layout.endswith("dim1") else 0),
                _fsdp_common.FSDPMeshInfo(efsdp, shard_mesh_dim=0))
            torch_fully_shard(block, mesh=dense["fsdp"], shard_placement_fn=lambda p: (
                on_efsdp if isinstance(p, DTensor) else None))
    torch_fully_shard(model, mesh=dense["fsdp"])
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(world)
            # gloo has no PREMUL_SUM, FSDP2's op for a divide factor: sum, then divide
            module.set_force_sum_reduction_for_comms(True)
    return model


FSDP2_LAYOUTS = [layout if not layout.startswith("on-mesh") or
                 hasattr(_fsdp_common, "ShardPlacementResult")
                 else pytest.param(layout, marks=pytest.mark.skip(
                     reason="this torch's FSDP2 has no mesh per parameter (torch >= 2.13)"))
                 for layout in ALL_LAYOUTS]
_FAST_FSDP2_LAYOUT = "on-mesh" if hasattr(_fsdp_common, "ShardPlacementResult") else "experts-units"
FSDP2_LAYOUTS_ONE_FAST = [
    layout if not isinstance(layout, str) or layout == _FAST_FSDP2_LAYOUT
    else pytest.param(layout, marks=pytest.mark.slow)  # the same path on another layout
    for layout in FSDP2_LAYOUTS]
"""``FSDP2_LAYOUTS`` with all but one marked slow, for the costliest tests."""


@pytest.mark.parametrize("layout", FSDP2_LAYOUTS_ONE_FAST)
def test_same_recipe_as_fsdp2_step_by_step(layout):
    ours = run_distributed(WORLD, _losses_under, "fsdp_compose", layout, timeout=120)
    theirs = run_distributed(WORLD, _losses_under, "fsdp2", layout, timeout=120)
    for got, want in zip(ours, theirs):
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6, (got, want)


def _collectives_by_mesh(layout: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard_moe(build_moe(), world, layout)
    tokens, targets = batch(0, PER_RANK)
    for _ in range(2):  # the verified iterations (their checks add all-gathers of their own)
        model.loss(tokens, targets).backward()
    with CollectiveCounter() as comm:
        model.loss(tokens, targets).backward()
    ops = {ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter"}
    return {"rank": rank,
            "groups": {(ops[op], ranks) for (op, ranks) in comm.by_ranks if op in ops},
            "bytes": {(ops[op], ranks): n for (op, ranks), n in comm.bytes_by_ranks.items()
                      if op in ops}}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_mesh_runs_its_own_collectives(layout):
    """Experts all-gather and reduce-scatter over efsdp (the 2 ranks that
    hold the same experts), everything else over all 4 ranks; the efsdp
    collectives carry exactly the experts' bytes: 2 blocks x (w1 + w2)
    local (2 experts of 6 x 10 each) = 480 floats, gathered in forward and
    again in backward, reduced once."""
    everyone = tuple(range(WORLD))
    for res in run_distributed(WORLD, _collectives_by_mesh, layout, timeout=90):
        efsdp = (res["rank"] % EP, res["rank"] % EP + EP)
        assert res["groups"] == {("all_gather", efsdp), ("all_gather", everyone),
                                 ("reduce_scatter", efsdp), ("reduce_scatter", everyone)}
        experts_floats = 2 * 2 * (2 * 6 * 10)
        assert res["bytes"]["all_gather", efsdp] == 2 * experts_floats * 4
        assert res["bytes"]["reduce_scatter", efsdp] == experts_floats // 2 * 4


def _reshard_through_dcp(path: str) -> dict:
    """Save at EP 2 x efsdp 2, load into the model without expert
    parallelism sharded over all 4 ranks (every rank runs every expert)."""
    world = dist.get_world_size()
    trained = shard_moe(build_moe(), world)
    _train(trained, "sgd", clip=False)
    saved = _full_state(trained)
    dcp.save(trained.state_dict(), checkpoint_id=path)
    torch.manual_seed(99)
    fresh = build_moe()
    for p in fresh.parameters():
        p.data.normal_()
    for block in fresh.blocks:
        fully_shard(block)
    fully_shard(fresh)
    _load_through_dcp(fresh, path)
    return {"saved": saved, "loaded": _full_state(fresh)}


def _load_through_dcp(model: nn.Module, path: str) -> None:
    """DCP reads ``path`` into ``model``'s own state dict (its layout), which
    the model then loads."""
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)


def _same_values(a: nn.Module, b: nn.Module) -> bool:
    want, got = _full_state(a), _full_state(b)
    return want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_checkpoint_moves_between_expert_parallel_and_plain_sharding(tmp_path):
    for res in run_distributed(WORLD, _reshard_through_dcp, str(tmp_path / "ckpt"), timeout=120):
        assert res["saved"].keys() == res["loaded"].keys()
        for name, value in res["saved"].items():
            assert torch.equal(value, res["loaded"][name]), name


def _int_reshard_with_another_mesh() -> str:
    dense, sparse = _meshes(dist.get_world_size())
    model = build_moe()
    enable_expert_parallel(model, sparse["ep"])
    try:
        fully_shard(model.blocks[0], mesh=dense["fsdp"], reshard_after_forward=2,
                    shard_placement_fn=lambda p: OnMesh(sparse["efsdp"]) if isinstance(p, DTensor)
                    else None)
    except ValueError as exc:
        return str(exc)
    return ""


def test_int_reshard_after_forward_with_another_mesh_raises_naming_the_parameter():
    for message in run_distributed(WORLD, _int_reshard_with_another_mesh, timeout=60):
        assert "reshard_after_forward=2" in message and "'moe.experts.w1'" in message, message


def _init_experts(module: nn.Module) -> None:
    if isinstance(module, Experts):
        nn.init.normal_(module.w1, std=D ** -0.5)
        nn.init.normal_(module.w2, std=D ** -0.5)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _train_from_meta(layout: str) -> dict:
    """The recipe as torchtitan runs it: build on the meta device, shard
    (experts are expert-parallel DTensors on the meta device), then
    ``materialize`` with an init function; then train."""
    world = dist.get_world_size()
    with torch.device("meta"):
        model = TinyMoELM()
    shard_moe(model, world, layout)
    torch.manual_seed(7)
    materialize(model, init_fn=_init_experts)
    initial = _full_state(model)
    return {**_train(model, "adamw"), "initial": initial, "params": _full_state(model)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_meta_device_build_materializes_and_trains(layout):
    """Every rank ends with the same global values; one process started
    from them and trained on the global batch matches."""
    results = run_distributed(WORLD, _train_from_meta, layout, timeout=120)
    initial = results[0]["initial"]
    for res in results[1:]:
        assert all(torch.equal(res["initial"][k], v) for k, v in initial.items())
    # initialised, not left as allocated (LayerNorm's bias is zero by design)
    assert all(v.abs().sum() > 0 for k, v in initial.items() if not k.endswith("bias")), initial
    reference_model = build_moe()
    reference_model.load_state_dict(initial)
    _assert_matches(results, _train_reference("adamw", WORLD, reference_model))


def _checkpoints_cross(root: str, layout: str) -> dict:
    """Ours saved, FSDP2 loads; FSDP2's saved, ours loads (DCP, the same
    recipe on the same meshes): the values arrive exactly."""
    world = dist.get_world_size()
    ours = shard_moe(build_moe(), world, layout)
    _train(ours, "sgd", clip=False)
    dcp.save(ours.state_dict(), checkpoint_id=f"{root}/ours")
    theirs = shard_moe_with_fsdp2(build_moe(), world, layout)
    _load_through_dcp(theirs, f"{root}/ours")
    fsdp2_loaded_ours = _same_values(ours, theirs)
    _train(theirs, "adamw", clip=False)  # now different values again
    dcp.save(theirs.state_dict(), checkpoint_id=f"{root}/theirs")
    fresh = shard_moe(build_moe(), world, layout)
    _load_through_dcp(fresh, f"{root}/theirs")
    return {"fsdp2_loaded_ours": fsdp2_loaded_ours, "ours_loaded_fsdp2": _same_values(theirs, fresh)}


@pytest.mark.parametrize("layout", FSDP2_LAYOUTS_ONE_FAST)
def test_checkpoints_cross_between_fsdp2_and_fsdp_compose(tmp_path, layout):
    for res in run_distributed(WORLD, _checkpoints_cross, str(tmp_path), layout, timeout=120):
        assert res == {"fsdp2_loaded_ours": True, "ours_loaded_fsdp2": True}, res
