"""``model.state_dict()`` / ``model.load_state_dict()`` of annotated models
in torch FSDP2's checkpoint layout (``fsdp_compose/checkpoint``).

Every managed parameter must come out as a ``DTensor`` of its original shape
placed ``Shard(0)`` on its unit's mesh (rank ``j`` holds
``torch.chunk(full, F, 0)[j]``), so that ``torch.distributed.checkpoint``
(DCP) checkpoints load across world sizes, into torch FSDP2 and into plain
unsharded models, and the other way round. Values are always compared
exactly against the unsharded reference (``build_lm()``) or against the
full values read through ``unshard()`` (``full_params``), which does not go
through the checkpoint code.

Checkpoints written by the module-scoped ``saved`` fixture (trained on
``F`` ranks) are shared by the loading tests.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fsdp_compose import fully_shard
from tests._models import (PER_RANK, SEED, TinyLM, build_lm, full_params, make_optim,
                           rank_slice, rank_world, shard_blocks_and_root, token_batch)
from tests.harness import run_distributed

TIMEOUT = 60
OTHER_SEED = 999  # a loading model starts from different values than the checkpoint


# ------------------------------------------------------------------ helpers (run on ranks)
def _build(seed: int = SEED, n_blocks: int = 2) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(n_blocks)


def _train(model: nn.Module, steps: int, optim=None, optim_name: str = "adamw", first_step: int = 0):
    """A few steps on this rank's slice of the global batch (fsdp_compose or
    torch FSDP2 alike). Returns the optimizer."""
    rank, world = rank_world()
    optim = optim if optim is not None else make_optim(model.parameters(), optim_name)
    for step in range(first_step, first_step + steps):
        tokens, targets = token_batch(step, PER_RANK * world)
        loss = model.loss(rank_slice(tokens, rank, world), rank_slice(targets, rank, world))
        loss.backward()
        optim.step()
        optim.zero_grad()
    return optim


def _dtensor_full_values(sd: dict) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in sd.items()}


def _describe(sd: dict) -> dict[str, dict]:
    """What the test process checks about each value of a state dict."""
    out = {}
    for key, v in sd.items():
        if isinstance(v, DTensor):
            out[key] = {"dtensor": True, "placements": tuple(v.placements), "shape": tuple(v.shape),
                        "mesh_size": v.device_mesh.size(), "local": v.to_local().detach().clone(),
                        "full": v.full_tensor().detach().clone(), "is_param": False}
        else:
            out[key] = {"dtensor": False, "shape": tuple(v.shape), "full": v.detach().clone(),
                        "is_param": isinstance(v, nn.Parameter)}
    return out


def _exact(got: dict, want: dict, what: str = "") -> None:
    assert sorted(got) == sorted(want), f"{what}: keys {sorted(got)} vs {sorted(want)}"
    for k, w in want.items():
        g = got[k]
        assert tuple(g.shape) == tuple(w.shape), f"{what}{k}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
        assert g.dtype == w.dtype, f"{what}{k}: dtype {g.dtype} vs {w.dtype}"
        assert torch.equal(g, w), f"{what}{k}: values differ (max {(g - w).abs().max().item():.3g})"


def _check_layout(desc: dict, reference: dict, world: int, rank: int, what: str) -> None:
    """Every parameter of ``desc`` is the Shard(0) DTensor torch FSDP2 returns."""
    _exact({k: d["full"] for k, d in desc.items()}, reference, what)
    for key, d in desc.items():
        full = reference[key]
        if full.dim() == 0 or key.endswith("_buf"):
            continue
        assert d["dtensor"], f"{what}{key} is a {type(d['full']).__name__}, not a DTensor"
        assert d["placements"] == (Shard(0),), f"{what}{key}: placements {d['placements']}"
        assert d["mesh_size"] == world, f"{what}{key}: mesh of size {d['mesh_size']}"
        assert d["shape"] == tuple(full.shape), f"{what}{key}: global shape {d['shape']}"
        pieces = torch.chunk(full, world, 0)
        want = pieces[rank] if rank < len(pieces) else full[full.shape[0]:]
        assert d["local"].shape == want.shape, f"{what}{key}: local {tuple(d['local'].shape)}"
        assert torch.equal(d["local"], want), f"{what}{key}: rank {rank}'s local chunk differs"


# ============================================================================
# a + h. state_dict layout, of the root and of submodules inside units
# ============================================================================
def _with_buffers(model: TinyLM) -> TinyLM:
    model.blocks[1].register_buffer("scale_buf", torch.arange(3.0) + 0.5)  # persistent
    model.norm.register_buffer("tmp_buf", torch.ones(2), persistent=False)
    return model


def state_dict_layout():
    model = shard_blocks_and_root(_with_buffers(build_lm()))
    sd = model.state_dict()
    params_after = [p.shape for p in model.parameters()]
    return {
        "root": _describe(sd),
        "block0.fc1": _describe(model.blocks[0].fc1.state_dict()),
        "block0": _describe(model.blocks[0].state_dict()),
        "blocks": _describe(model.blocks.state_dict()),
        "lm_head": _describe(model.lm_head.state_dict(prefix="lm_head.")),
        "root_again": _describe(model.state_dict()),  # hooks leave no stale state behind
        "params_after": params_after,
    }


@pytest.mark.parametrize("world", [1, 2, 3])
def test_state_dict_is_fsdp2_shard0_dtensors(world):
    ref_model = _with_buffers(build_lm())
    ref = {k: v.detach().clone() for k, v in ref_model.state_dict().items()}
    assert "blocks.1.scale_buf" in ref and "norm.tmp_buf" not in ref
    results = run_distributed(world, state_dict_layout, timeout=TIMEOUT)
    for rank, res in enumerate(results):
        _check_layout(res["root"], ref, world, rank, f"rank {rank}: ")
        _check_layout(res["root_again"], ref, world, rank, f"rank {rank} (2nd call): ")
        assert not res["root"]["blocks.1.scale_buf"]["dtensor"]
        # submodules inside units: keys relative to the submodule, values in full
        sub = {"block0.fc1": ("blocks.0.fc1.", ""), "block0": ("blocks.0.", ""),
               "blocks": ("blocks.", ""), "lm_head": ("lm_head.", "lm_head.")}
        for name, (strip, prefix) in sub.items():
            want = {prefix + k[len(strip):]: v for k, v in ref.items() if k.startswith(strip)}
            _check_layout(res[name], want, world, rank, f"rank {rank}: {name}.state_dict() ")
        # between iterations the parameters stay this rank's pieces (rows: ndim kept)
        assert [len(s) for s in res["params_after"]] == [p.dim() for p in ref_model.parameters()]


# ============================================================================
# b. DCP save after training; a new model loads it (identity, optimizer)
# ============================================================================
def train_and_save(path: str, steps: int = 2):
    model = shard_blocks_and_root(build_lm())
    _train(model, steps)
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    return full_params(model)


def load_into_new_model_and_train(path: str):
    """Load ``path`` into a differently seeded model whose optimizer was built
    before loading; then one SGD step, and the same step on a model that
    never went through a checkpoint (the trained values loaded as full
    tensors) for comparison."""
    model = shard_blocks_and_root(_build(OTHER_SEED))
    params_before = list(model.parameters())
    optim = make_optim(model.parameters(), "sgd")
    before_load = full_params(model)
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    result = model.load_state_dict(sd["model"])
    loaded = full_params(model)
    same_objects = len(params_before) == len(list(model.parameters())) and all(
        a is b for a, b in zip(params_before, model.parameters()))
    _train(model, 1, optim=optim, first_step=10)
    return {"before": before_load, "loaded": loaded, "same_objects": same_objects,
            "missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys),
            "trained": full_params(model)}


def continue_from_values(values: dict):
    """Reference for the step after loading: a model loaded from full
    tensors (the trained values), fresh SGD, the same step."""
    model = shard_blocks_and_root(_build(OTHER_SEED))
    model.load_state_dict(values)
    assert all(torch.equal(v, values[k]) for k, v in full_params(model).items())
    _train(model, 1, optim_name="sgd", first_step=10)
    return full_params(model)


_SAVED: dict[int, tuple[str, dict]] = {}


@pytest.fixture(scope="module")
def saved():
    """``saved(F)``: (directory, full trained values) of a checkpoint written on
    ``F`` ranks (each written once per module)."""
    root = tempfile.mkdtemp(prefix="fsdp-compose-ckpt-")

    def get(world: int) -> tuple[str, dict]:
        if world not in _SAVED:
            path = os.path.join(root, f"ws{world}")
            values = run_distributed(world, train_and_save, path, timeout=TIMEOUT)
            for v in values[1:]:
                _exact(v, values[0], "ranks disagree: ")
            _SAVED[world] = (path, values[0])
        return _SAVED[world]

    yield get
    _SAVED.clear()
    shutil.rmtree(root, ignore_errors=True)


def test_dcp_round_trip_keeps_identity_and_optimizer(saved):
    path, trained = saved(2)
    initial = build_lm().state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained), "training changed nothing"
    results = run_distributed(2, load_into_new_model_and_train, path, timeout=TIMEOUT)
    reference = run_distributed(2, continue_from_values, trained, timeout=TIMEOUT)
    for rank, res in enumerate(results):
        assert any(not torch.equal(res["before"][k], trained[k]) for k in trained)
        _exact(res["loaded"], trained, f"rank {rank}: loaded ")
        assert res["same_objects"], f"rank {rank}: load_state_dict replaced parameter objects"
        assert res["missing"] == [] and res["unexpected"] == []
        assert any(not torch.equal(res["trained"][k], trained[k]) for k in trained), \
            f"rank {rank}: the optimizer built before loading no longer updates the parameters"
        _exact(res["trained"], reference[rank], f"rank {rank}: after one step ")


# ============================================================================
# c. Resharding through DCP: saved on F ranks, loaded on G
# ============================================================================
def load_values(path: str):
    model = shard_blocks_and_root(_build(OTHER_SEED))
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"])
    return full_params(model)


@pytest.mark.parametrize("save_world,load_world", [(2, 1), (2, 3), (3, 2), (4, 2)])
def test_dcp_resharding(saved, save_world, load_world):
    path, trained = saved(save_world)
    for rank, values in enumerate(run_distributed(load_world, load_values, path, timeout=TIMEOUT)):
        _exact(values, trained, f"{save_world}->{load_world} rank {rank}: ")


# ============================================================================
# d. Into a plain unsharded model, in this process (no process group)
# ============================================================================
def test_dcp_into_plain_model_and_torch_save(saved, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, trained = saved(2)
    assert not dist.is_initialized()
    plain = _build(OTHER_SEED)
    sd = {"model": plain.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    plain.load_state_dict(sd["model"])
    _exact({k: v.detach() for k, v in plain.state_dict().items()}, trained, "plain model: ")

    file = tmp_path / "model.pt"
    dcp_to_torch_save(path, file)
    loaded = torch.load(file, weights_only=True)
    assert set(loaded) == {"model"}, sorted(loaded)
    _exact(loaded["model"], trained, "dcp_to_torch_save: ")


# ============================================================================
# e. Interoperability with torch FSDP2
# ============================================================================
def _torch_fsdp2_model(seed: int) -> TinyLM:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _build(seed)
    for block in model.blocks:
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    return model


def torch_fsdp2_to_fsdp_compose(path: str):
    """torch FSDP2 trains and saves; fsdp_compose loads."""
    torch_model = _torch_fsdp2_model(SEED)
    _train(torch_model, 2)
    torch_sd = torch_model.state_dict()
    written = _dtensor_full_values(torch_sd)
    dcp.save({"model": torch_sd}, checkpoint_id=path)
    ours = shard_blocks_and_root(_build(OTHER_SEED))
    sd = {"model": ours.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    ours.load_state_dict(sd["model"])
    # and what fsdp_compose's state_dict() returns equals torch FSDP2's, local chunks included
    ours_sd = ours.state_dict()
    same_locals = {k: torch.equal(ours_sd[k].to_local(), v.to_local()) for k, v in torch_sd.items()}
    return {"written": written, "loaded": full_params(ours), "same_locals": same_locals}


def fsdp_compose_to_torch_fsdp2(path: str):
    torch_model = _torch_fsdp2_model(OTHER_SEED)
    sd = {"model": torch_model.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    torch_model.load_state_dict(sd["model"])
    return _dtensor_full_values(torch_model.state_dict())


def test_torch_fsdp2_checkpoint_loads_into_fsdp_compose(tmp_path):
    path = str(tmp_path / "torch_fsdp2")
    results = run_distributed(2, torch_fsdp2_to_fsdp_compose, path, timeout=TIMEOUT)
    written = results[0]["written"]
    initial = build_lm().state_dict()
    assert any(not torch.equal(written[k], initial[k]) for k in written), "training changed nothing"
    for rank, res in enumerate(results):
        _exact(res["written"], written, f"rank {rank}: torch FSDP2 ")
        _exact(res["loaded"], written, f"rank {rank}: fsdp_compose loaded ")
        assert all(res["same_locals"].values()), f"rank {rank}: {res['same_locals']}"


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_compose_checkpoint_loads_into_torch_fsdp2(saved, world):
    path, trained = saved(2)
    for rank, values in enumerate(run_distributed(world, fsdp_compose_to_torch_fsdp2, path,
                                                  timeout=TIMEOUT)):
        _exact(values, trained, f"torch FSDP2 rank {rank}: ")


# ============================================================================
# f. Errors: shapes, missing and unexpected keys, pre-feature local slices
# ============================================================================
def _error_of(fn) -> str:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return ""


def load_errors():
    model = shard_blocks_and_root(build_lm())
    good = full_params(model)
    out = {}

    bad = model.state_dict()
    bad["lm_head.weight"] = torch.zeros(96, 7)
    out["mis-shaped full"] = _error_of(lambda: model.load_state_dict(bad))

    bad = model.state_dict()
    mesh = bad["lm_head.weight"].device_mesh
    bad["lm_head.weight"] = distribute_tensor(torch.zeros(96, 7), mesh, [Shard(0)])
    out["mis-shaped dtensor"] = _error_of(lambda: model.load_state_dict(bad))

    missing = model.state_dict()
    del missing["norm.weight"]
    out["missing"] = _error_of(lambda: model.load_state_dict(missing))
    res = model.load_state_dict(missing, strict=False)
    out["missing non-strict"] = (list(res.missing_keys), list(res.unexpected_keys))

    extra = model.state_dict()
    extra["blocks.0.fc1.extra"] = torch.ones(3)
    out["unexpected"] = _error_of(lambda: model.load_state_dict(extra))
    res = model.load_state_dict(extra, strict=False)
    out["unexpected non-strict"] = (list(res.missing_keys), list(res.unexpected_keys))

    # what state_dict() returned before the checkpoint feature: this rank's 1-D slices
    legacy = {name: p.detach().clone() for name, p in model.named_parameters()}
    out["legacy"] = _error_of(lambda: model.load_state_dict(legacy))
    out["after legacy"] = full_params(model)
    # zeros of the same shapes: a key whose slice here is the whole parameter (a bias one
    # rank owns entirely) is a valid full tensor; every other key must be rejected
    legacy_zeros = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    out["local shapes"] = {name: tuple(p.shape) for name, p in model.named_parameters()}
    out["legacy zeros"] = _error_of(lambda: model.load_state_dict(legacy_zeros))
    out["after legacy zeros"] = full_params(model)
    out["good"] = good
    return out


def _torch_size_mismatch_line() -> str:
    """torch's own message for loading lm_head.weight of shape (96, 7) into an unsharded model."""
    plain = build_lm()
    sd = plain.state_dict()
    sd["lm_head.weight"] = torch.zeros(96, 7)
    with pytest.raises(RuntimeError) as error:
        plain.load_state_dict(sd)
    return next(line.strip() for line in str(error.value).splitlines()
                if "size mismatch for lm_head.weight" in line)


def test_load_state_dict_errors():
    shapes = {name: tuple(p.shape) for name, p in build_lm().named_parameters()}
    results = run_distributed(3, load_errors, timeout=TIMEOUT)
    for rank, out in enumerate(results):
        for case in ("mis-shaped full", "mis-shaped dtensor"):
            msg = out[case]
            assert "size mismatch for lm_head.weight" in msg, f"rank {rank} {case}: {msg!r}"
            assert "96, 7" in msg and "97, 7" in msg, f"rank {rank} {case}: {msg!r}"
        assert "Missing key(s)" in out["missing"] and '"norm.weight"' in out["missing"], out["missing"]
        assert out["missing non-strict"] == (["norm.weight"], [])
        assert "Unexpected key(s)" in out["unexpected"] and '"blocks.0.fc1.extra"' in out["unexpected"]
        assert out["unexpected non-strict"] == ([], ["blocks.0.fc1.extra"])
        for case in ("legacy", "legacy zeros"):
            msg = out[case]
            assert msg, f"rank {rank}: {case} 1-D local slices were loaded without an error"
            for name, shape in shapes.items():
                if len(shape) >= 2:  # a 2-D weight's slice is never its full shape
                    assert f"size mismatch for {name}" in msg, f"rank {rank} {case}: {name}: {msg}"
        _exact(out["after legacy"], out["good"], f"rank {rank}: after loading local slices ")
    # after the zeros: only keys some rank held whole were written (with zeros)
    good = results[0]["good"]
    whole = {k for out in results for k, s in out["local shapes"].items() if s == shapes[k]}
    assert whole, "no rank holds a whole parameter: the zeros case checks nothing"
    want = {k: torch.zeros_like(v) if k in whole else v for k, v in good.items()}
    for rank, out in enumerate(results):
        _exact(out["after legacy zeros"], want, f"rank {rank}: after loading zeroed local slices ")
        for k, s in out["local shapes"].items():
            if s != shapes[k]:
                assert f"size mismatch for {k}:" in out["legacy zeros"], (rank, k, out["legacy zeros"])


# ============================================================================
# g. Full plain tensors; a weight tied inside one unit; a 0-dim parameter
# ============================================================================
class _Scaled(TinyLM):
    def __init__(self) -> None:
        super().__init__(1)
        self.gain = nn.Parameter(torch.tensor(1.5))

    def forward(self, tokens, head=True):
        return super().forward(tokens, head) * self.gain


def _tied(seed: int) -> TinyLM:
    model = _build(seed, n_blocks=1)
    model.lm_head.weight = model.tok_emb.weight  # (97, 7) both
    return model


def load_full_and_tied(full: dict, tied_full: dict, scalar_full: dict, path: str):
    out = {}
    # full plain tensors into a blocks-and-root model
    model = shard_blocks_and_root(_build(OTHER_SEED))
    params_before = list(model.parameters())
    model.load_state_dict(full)
    out["full"] = full_params(model)
    out["full_identity"] = all(a is b for a, b in zip(params_before, model.parameters()))

    # a weight tied inside a root-only unit: state_dict round trip, and through DCP
    src = _tied(SEED)
    fully_shard(src)
    _train(src, 1)
    src_sd = src.state_dict()
    out["tied_src_keys"] = sorted(src_sd)
    out["tied_src"] = _dtensor_full_values(src_sd)
    dst = _tied(OTHER_SEED)
    fully_shard(dst)
    dst.load_state_dict(src.state_dict())
    out["tied_dst"] = _dtensor_full_values(dst.state_dict())
    out["tied_still_tied"] = dst.lm_head.weight is dst.tok_emb.weight
    dcp.save({"model": src.state_dict()}, checkpoint_id=path)
    dst2 = _tied(OTHER_SEED)
    fully_shard(dst2)
    sd = {"model": dst2.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    dst2.load_state_dict(sd["model"])
    out["tied_dcp"] = _dtensor_full_values(dst2.state_dict())
    # full tensors into the tied model
    dst3 = _tied(OTHER_SEED)
    fully_shard(dst3)
    dst3.load_state_dict(tied_full)
    out["tied_full"] = full_params(dst3)

    # a 0-dim parameter: every rank holds it whole
    torch.manual_seed(OTHER_SEED)
    scalar = _Scaled()
    with torch.no_grad():
        scalar.gain.fill_(-2.0)
    for block in scalar.blocks:
        fully_shard(block)
    fully_shard(scalar)
    scalar.load_state_dict(scalar_full)
    out["scalar_sd"] = _dtensor_full_values(scalar.state_dict())
    out["scalar_full"] = full_params(scalar)
    return out


def test_load_full_tensors_tied_weights_and_scalars(tmp_path):
    full = _build(OTHER_SEED + 1).state_dict()  # neither the init nor the loading model's seed
    tied_full = {k: v for k, v in _tied(OTHER_SEED + 2).state_dict().items()}
    torch.manual_seed(OTHER_SEED + 3)
    scalar_model = _Scaled()
    scalar_full = scalar_model.state_dict()
    results = run_distributed(2, load_full_and_tied, full, tied_full, scalar_full,
                              str(tmp_path / "tied"), timeout=TIMEOUT)
    for rank, out in enumerate(results):
        _exact(out["full"], full, f"rank {rank}: full tensors ")
        assert out["full_identity"]
        assert out["tied_src_keys"] == sorted(tied_full), out["tied_src_keys"]
        src = out["tied_src"]
        assert torch.equal(src["lm_head.weight"], src["tok_emb.weight"])
        assert not torch.equal(src["tok_emb.weight"], _tied(SEED).tok_emb.weight.detach()), \
            "training changed nothing"
        _exact(out["tied_dst"], src, f"rank {rank}: tied state_dict round trip ")
        assert out["tied_still_tied"]
        _exact(out["tied_dcp"], src, f"rank {rank}: tied through DCP ")
        want_tied = {k: v for k, v in tied_full.items() if k != "lm_head.weight"}
        _exact(out["tied_full"], want_tied, f"rank {rank}: tied from full tensors ")
        _exact(out["scalar_sd"], scalar_full, f"rank {rank}: 0-dim state_dict ")
        _exact(out["scalar_full"], scalar_full, f"rank {rank}: 0-dim loaded ")


def size_mismatch_message():
    model = shard_blocks_and_root(build_lm())
    sd = model.state_dict()
    sd["lm_head.weight"] = torch.zeros(96, 7)
    return _error_of(lambda: model.load_state_dict(sd))


def test_size_mismatch_message_is_torchs():
    """The same wording as torch's (``torch.Size([96, 7])`` for the
    checkpoint's shape too), so tools that parse it keep working."""
    torch_line = _torch_size_mismatch_line()
    for rank, msg in enumerate(run_distributed(1, size_mismatch_message, timeout=TIMEOUT)):
        assert torch_line in msg, f"rank {rank}: {msg!r}\nis not torch's {torch_line!r}"
