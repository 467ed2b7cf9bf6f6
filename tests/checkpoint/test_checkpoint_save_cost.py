"""What a checkpoint save does per parameter and per byte beyond FSDP2's:
torch's recipe (``get_state_dict`` + ``dcp.save``) on an annotated model
after AdamW steps (torch's state, then the flat step's views of flat state).

1. DCP's file writer copies every CPU tensor whose storage is larger than
   the tensor (``tensor.clone()`` in its loader) before writing it; a piece
   of a flat shard is such a view. Every tensor DCP resolves to write must
   be one it writes as it lies (its storage exactly its bytes), with the
   values of the saved state, and reading the checkpoint back gives them.
2. The optimizer's plan exchange (an object all-gather) carries no tensor:
   pickling one costs a ``torch.save`` per parameter on every rank.
3. ``get_state_dict`` makes one value per parameter and per optimizer state,
   and no view of the shards' memory for them: a box's view is made when DCP
   resolves it, one per box written (at most three tensor calls each), and
   none for the boxes DCP only plans.

Run: PYTHONPATH=$PWD python -m pytest -q tests/checkpoint/test_checkpoint_save_cost.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from tests._models import TinyLM, rank_slice, shard_blocks_and_root, token_batch
from tests.harness import run_distributed

WORLD = 3  # uneven: pieces of the flat shards start and end inside rows


class _Watching(DefaultSavePlanner):
    """DCP's default planner, noting each tensor it hands the writer."""

    def __init__(self) -> None:
        super().__init__()
        self.copied: list[str] = []
        self.written = 0

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor):
            self.written += 1
            if data.untyped_storage().nbytes() != data.nbytes:
                self.copied.append(write_item.index.fqn)
        return data


def _save_work(directory: str, steps: int) -> dict:
    torch.manual_seed(0)
    model = shard_blocks_and_root(TinyLM(n_blocks=2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):  # the first step is torch's; later ones flat (views of flat state)
        tokens, targets = token_batch(step, 6)
        model.loss(rank_slice(tokens, rank, world), rank_slice(targets, rank, world)).backward()
        optim.step()
        optim.zero_grad()
    carried: list[str] = []
    original = dist.all_gather_object

    def watching(output, obj, group=None):
        carried.extend(type(leaf).__name__ for leaf in tree_leaves(obj)
                       if isinstance(leaf, torch.Tensor))
        return original(output, obj, group=group)

    dist.all_gather_object = watching
    try:
        msd, osd = get_state_dict(model, optim)
    finally:
        dist.all_gather_object = original
    planner = _Watching()
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{directory}/{steps}", planner=planner)
    expected = {k: v.full_tensor() for k, v in get_state_dict(model, [])[0].items()}
    expected.update({f"{fqn}.{name}": value.full_tensor()
                     for fqn, values in get_state_dict(model, optim)[1]["state"].items()
                     for name, value in values.items() if name != "step"})
    loaded = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load({"model": {k: loaded[k] for k in msd},
              "optim": {"state": {fqn: {name: loaded[f"{fqn}.{name}"] for name in values
                                        if name != "step"}
                                  for fqn, values in osd["state"].items()}}},
             checkpoint_id=f"{directory}/{steps}", no_dist=True)
    return {"copied": planner.copied, "written": planner.written, "carried": carried,
            "differ": [k for k in expected if not torch.equal(loaded[k], expected[k])]}


class _Views(TorchFunctionMode):
    """Counts the tensor calls that make a view of a box (see 3.)."""

    NAMES = ("reshape", "narrow", "view")

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _views_made(directory: str) -> dict:
    torch.manual_seed(0)
    model = shard_blocks_and_root(TinyLM(n_blocks=2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        tokens, targets = token_batch(step, 6)
        model.loss(rank_slice(tokens, rank, world), rank_slice(targets, rank, world)).backward()
        optim.step()
        optim.zero_grad()
    with _Views() as taking:
        msd, osd = get_state_dict(model, optim)
    planner = _Watching()
    with _Views() as saving:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory, planner=planner)
    return {"taking": taking.calls, "saving": saving.calls, "written": planner.written}


def test_get_state_dict_makes_no_view_and_the_save_one_per_box_written(tmp_path):
    for rank, out in enumerate(run_distributed(WORLD, _views_made, str(tmp_path))):
        assert out["written"] > 0, out
        assert out["taking"] == 0, f"rank {rank}: get_state_dict made views: {out}"
        # a range box's view is three calls (reshape, narrow, view), a Shard(d) box's none
        assert out["saving"] <= 3 * out["written"], f"rank {rank}: views per box written: {out}"


def test_dcp_writes_every_piece_as_it_lies_and_the_exchange_carries_no_tensor(tmp_path):
    for steps in (1, 3):  # torch's per-parameter state; the flat step's views
        for rank, out in enumerate(run_distributed(WORLD, _save_work, str(tmp_path), steps)):
            assert out["written"] > 0, out
            assert out["copied"] == [], f"rank {rank}, {steps} steps: DCP copies {out['copied']}"
            assert out["carried"] == [], f"rank {rank}: tensors pickled: {out['carried']}"
            assert out["differ"] == [], f"rank {rank}: read back differently: {out['differ']}"
