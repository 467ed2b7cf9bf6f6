"""Checkpoints at disk speed: torch's recipe over lazy values, and the explicit
zero-copy path (``flat_state_dict`` + ``FlatSavePlanner`` / ``FlatLoadPlanner``):
each rank writes its flat shard's pieces as DCP boxes and reads them straight
back.

What must hold, each checked against code that does not use the path
(torch's ``get_state_dict(..., full_state_dict=True)`` over our ``DTensor``
conversion, torch FSDP2, a plain model):

* the boxes of a flat range cover it exactly, in order (pure math);
* saving and loading exchange nothing (no all-to-all, no all-gather) and the
  values handed to DCP share the shards' memory; through torch's recipe too
  (``get_state_dict`` + ``dcp.save``, ``dcp.load`` + ``set_state_dict``), where
  no lazy value is converted;
* a checkpoint saved under one placement resumes under another (same
  optimizer step on both sides afterwards), and at another world size;
* the files load into torch FSDP2 and into an unsharded model, and torch
  FSDP2's files load through the path;
* DCP's default planners refuse these values with a message naming ours.

Run: PYTHONPATH=$PWD python -m pytest -q tests/checkpoint/test_checkpoint_flat.py
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.tensor import DTensor

from fsdp_compose.checkpoint import FlatLoadPlanner, FlatSavePlanner, flat_state_dict
from fsdp_compose.checkpoint._boxes import range_boxes
from fsdp_compose.checkpoint._lazy import LazyChunk
from fsdp_compose.checkpoint._pieces import ShardPieces
from tests._comm_counter import CollectiveCounter
from tests._training import build_model, make_optimizer
from tests.harness import run_distributed
from tests.core.test_placements import _adamw_step, shard_with

TIMEOUT = 90


# ------------------------------------------------------------------ pure math
def test_range_boxes_cover_the_range_in_order():
    rng = random.Random(0)
    shapes = [(7,), (4, 5), (3, 1, 4), (2, 3, 2, 5), (6, 1), (1, 9), (0, 3), (3, 0, 2), ()]
    for shape in shapes:
        n = math.prod(shape)
        ranges = [(0, n), (0, 0)] + [tuple(sorted(rng.sample(range(n + 1), 2))) for _ in range(40)
                                     if n >= 1]
        for start, stop in ranges:
            boxes = range_boxes(shape, start, stop)
            cursor = start
            for box in boxes:
                assert box.flat_start == cursor, (shape, start, stop, boxes)
                # the box's elements, in row-major order, are exactly the next `numel` ones
                index = torch.arange(max(n, 1)).reshape(shape) if n else torch.empty(shape)
                region = index[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
                assert region.reshape(-1).tolist() == list(range(cursor, cursor + box.numel)), \
                    (shape, start, stop, box)
                cursor += box.numel
            assert cursor == stop, (shape, start, stop, boxes)
            assert len(boxes) <= max(1, 2 * len(shape) - 1), (shape, start, stop, boxes)
            if len(shape) >= 1 and n and start % (n // shape[0]) == 0 and stop % (n // shape[0]) == 0:
                assert len(boxes) <= 1, f"whole rows are one box: {boxes}"


# ------------------------------------------------------------------ on ranks
_step = _adamw_step  # one step on this rank's slice of the global batch


def _full_state(model, optim) -> dict:
    """Model and optimizer state in full, through the DTensor conversion
    (gathered in sorted key order: under "owned", torch's full_state_dict
    gathers the optimizer state in each rank's own dict order, which differs)."""
    msd, osd = get_state_dict(model, optim)
    flat = {f"model.{k}": v for k, v in msd.items()}
    flat.update({f"optim.{k}.{n}": v for k, s in osd["state"].items() for n, v in s.items()})
    full = {k: (flat[k].full_tensor() if isinstance(flat[k], DTensor) else flat[k]).detach().clone()
            for k in sorted(flat)}
    return {"model": {k[6:]: v for k, v in full.items() if k.startswith("model.")},
            "optim": {k[6:]: v for k, v in full.items() if k.startswith("optim.")}}


def _shares_shard_memory(model_sd: dict) -> bool:
    pieces = [v for v in model_sd.values() if isinstance(v, ShardPieces)]
    storages = {p.local.untyped_storage().data_ptr() for p in pieces}
    views = all(t.untyped_storage().data_ptr() == p.local.untyped_storage().data_ptr()
                for p in pieces for _, t in p.views())
    return bool(pieces) and views and len(storages) < len(pieces)


def _unused_lazy(model_sd: dict, optim_sd: dict) -> bool:
    """Every value of torch's recipe is a lazy chunk that nothing converted."""
    values = list(model_sd.values()) + [v for s in optim_sd["state"].values() for v in s.values()
                                        if isinstance(v, DTensor)]
    return all(isinstance(v._local_tensor, LazyChunk) and not v._local_tensor.materialized
               for v in values if isinstance(v, DTensor))


def save_flat(placement: str, path: str, steps: int = 2, recipe: bool = False) -> dict:
    model = shard_with(build_model("gpt"), placement)
    optim = make_optimizer(model, "adamw")
    for step in range(steps):
        _step(model, optim, step)
    with CollectiveCounter() as counter:
        if recipe:  # torch's own: get_state_dict + dcp.save, default planner
            msd, osd = get_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        else:
            msd, osd = flat_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, planner=FlatSavePlanner())
    out = {"views": _unused_lazy(msd, osd) if recipe else _shares_shard_memory(msd),
           "exchanges": _exchanges(counter)}
    out["full"] = _full_state(model, optim)
    _step(model, optim, steps)
    out["next"] = _full_state(model, optim)["model"]
    return out


def load_flat(placement: str, path: str, steps: int = 2, recipe: bool = False) -> dict:
    model = shard_with(build_model("gpt"), placement)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # start from other values than the checkpoint's
    optim = make_optimizer(model, "adamw")
    with CollectiveCounter() as counter:
        if recipe:  # torch's own: get_state_dict + dcp.load + set_state_dict
            msd, osd = get_state_dict(model, optim)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        else:
            msd, osd = flat_state_dict(model, optim)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=path, planner=FlatLoadPlanner())
        unused = _unused_lazy(msd, osd) if recipe else True
        set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    out = {"full": _full_state(model, optim), "exchanges": _exchanges(counter), "unused": unused}
    _step(model, optim, steps)
    out["next"] = _full_state(model, optim)["model"]
    return out


def _exchanges(counter: CollectiveCounter) -> dict:
    """Collectives that move values (not the plan's small object exchanges,
    which move pickled bytes and sizes: from torch 2.15 DCP exchanges them
    with ``_allgather_base_`` too, in uint8 and int64)."""
    return {str(op): n for op, n in counter.counts.items()
            if ("alltoall" in str(op) or "allgather_base" in str(op) or "reduce_scatter" in str(op))
            and any(d.is_floating_point for d in counter.dtypes.get(op, ()))}


def _exact(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys {sorted(set(got) ^ set(want))}"
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, f"{what}{k}"
        assert torch.equal(got[k], w), f"{what}{k}: differs by {(got[k] - w).abs().max().item()}"


_SLOW = pytest.mark.slow  # the default run keeps one case of each test


@pytest.mark.parametrize("saved_as,loaded_as", [
    ("flat0", "rows"), pytest.param("owned", "shard1", marks=_SLOW),
    pytest.param("shard1", "flat0", marks=_SLOW), pytest.param("blocks2", "owned", marks=_SLOW)])
def test_resume_under_another_placement_without_exchange(tmp_path, saved_as, loaded_as):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(3, save_flat, saved_as, path, timeout=TIMEOUT)
    loaded = run_distributed(3, load_flat, loaded_as, path, timeout=TIMEOUT)
    for rank, (s, l) in enumerate(zip(saved, loaded)):
        _exact(l["full"]["model"], s["full"]["model"], f"rank {rank} model ")
        _exact(l["full"]["optim"], s["full"]["optim"], f"rank {rank} optim ")
        # the next AdamW step agrees: state and step counts came back
        for key, want in s["next"].items():
            torch.testing.assert_close(l["next"][key], want, rtol=0, atol=1e-6)
        assert s["views"], f"rank {rank}: the saved values do not share the shards' memory"
        assert s["exchanges"] == {} and l["exchanges"] == {}, (s["exchanges"], l["exchanges"])


@pytest.mark.parametrize("saved_as,loaded_as", [("rows", "owned"),
                                                pytest.param("owned", "flat0", marks=_SLOW)])
def test_torch_recipe_saves_and_loads_in_place(tmp_path, saved_as, loaded_as):
    """get_state_dict + dcp.save and dcp.load + set_state_dict with DCP's default
    planners: no value is converted (lazy chunks stay unused), nothing is
    exchanged, and the resumed run continues like the saved one."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(3, save_flat, saved_as, path, recipe=True, timeout=TIMEOUT)
    loaded = run_distributed(3, load_flat, loaded_as, path, recipe=True, timeout=TIMEOUT)
    for rank, (s, l) in enumerate(zip(saved, loaded)):
        _exact(l["full"]["model"], s["full"]["model"], f"rank {rank} model ")
        _exact(l["full"]["optim"], s["full"]["optim"], f"rank {rank} optim ")
        for key, want in s["next"].items():
            torch.testing.assert_close(l["next"][key], want, rtol=0, atol=1e-6)
        assert s["views"] and l["unused"], f"rank {rank}: a value was converted"
        assert s["exchanges"] == {} and l["exchanges"] == {}, (s["exchanges"], l["exchanges"])


def full_optimizer_state_under_owned() -> dict:
    model = shard_with(build_model("gpt"), "owned")
    optim = make_optimizer(model, "adamw")
    for step in range(2):
        _step(model, optim, step)
    want = _full_state(model, optim)["optim"]  # gathered in sorted key order
    _, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    got = {f"{k}.{n}": v for k, s in osd["state"].items() for n, v in s.items()}
    return {"want": want, "got": got}


def test_full_optimizer_state_dict_under_owned():
    """torch's full_state_dict gathers the optimizer state in dict order: every
    rank must list it in the same order (under "owned" a rank's optimizer has
    state only for what it holds; it used to hang in mismatched all-gathers)."""
    for rank, res in enumerate(run_distributed(3, full_optimizer_state_under_owned,
                                               timeout=TIMEOUT)):
        _exact(res["got"], res["want"], f"rank {rank} ")


@pytest.fixture(scope="module")
def flat0_on_two_ranks(tmp_path_factory) -> tuple[str, dict]:
    """A checkpoint saved by 2 ranks under "flat0" through the flat path,
    and what rank 0 saw (``save_flat``'s result): several tests load it,
    none writes to it (callers only read the result)."""
    path = str(tmp_path_factory.mktemp("flat0_on_2") / "ckpt")
    return path, run_distributed(2, save_flat, "flat0", path, timeout=TIMEOUT)[0]


def test_flat_checkpoint_loads_at_another_world_size(flat0_on_two_ranks):
    path, saved = flat0_on_two_ranks
    for rank, res in enumerate(run_distributed(3, load_flat, "rows", path, timeout=TIMEOUT)):
        _exact(res["full"]["model"], saved["full"]["model"], f"3 ranks, rank {rank} model ")
        _exact(res["full"]["optim"], saved["full"]["optim"], f"3 ranks, rank {rank} optim ")


# ------------------------------------------------------------- torch FSDP2
def _fsdp2(seed_offset: float):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model("gpt")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(seed_offset)
    for block in model.blocks:
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    return model, make_optimizer(model, "adamw")


def fsdp2_loads(path: str) -> dict:
    model, optim = _fsdp2(1.0)
    _step(model, optim, 0)  # optimizer state to overwrite
    msd, osd = get_state_dict(model, optim)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    return _full_state(model, optim)


def fsdp2_saves(path: str) -> dict:
    model, optim = _fsdp2(0.0)
    for step in range(2):
        _step(model, optim, step)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return _full_state(model, optim)


def test_torch_fsdp2_and_the_flat_path_load_each_others_files(tmp_path, flat0_on_two_ranks):
    (ours, saved), theirs = flat0_on_two_ranks, str(tmp_path / "theirs")
    for rank, res in enumerate(run_distributed(3, fsdp2_loads, ours, timeout=TIMEOUT)):
        _exact(res["model"], saved["full"]["model"], f"FSDP2 rank {rank} model ")
        _exact(res["optim"], saved["full"]["optim"], f"FSDP2 rank {rank} optim ")
    written = run_distributed(2, fsdp2_saves, theirs, timeout=TIMEOUT)[0]
    for rank, res in enumerate(run_distributed(2, load_flat, "owned", theirs, timeout=TIMEOUT)):
        _exact(res["full"]["model"], written["model"], f"ours from FSDP2, rank {rank} model ")
        _exact(res["full"]["optim"], written["optim"], f"ours from FSDP2, rank {rank} optim ")


def test_flat_checkpoint_loads_into_an_unsharded_model(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(3, save_flat, "shard1", path, timeout=TIMEOUT)[0]
    assert not dist.is_initialized()
    plain = build_model("gpt")
    sd = {"model": plain.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    plain.load_state_dict(sd["model"])
    _exact({k: v.detach() for k, v in plain.state_dict().items()}, saved["full"]["model"],
           "plain model ")


def default_planner_error() -> str:
    model = shard_with(build_model("gpt"), "flat0")
    msd, _ = flat_state_dict(model)
    try:
        dcp.save({"model": msd}, checkpoint_id=f"/tmp/fsdp_compose_refused_{dist.get_rank()}",
                 no_dist=True)
    except CheckpointException as e:  # DCP's wrapper of each rank's error (a BaseException)
        return str(e)
    return ""


def test_default_planner_is_refused_with_a_message_naming_ours():
    for message in run_distributed(2, default_planner_error, timeout=TIMEOUT):
        assert "planner=FlatSavePlanner()" in message, message
