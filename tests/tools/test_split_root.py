"""``fully_shard_root`` ([Note: split root] in
``tools/split_root.py``): the root's embeddings and its final norm + head
become units of their own; same numbers as one process, counted, and the
head's reduction is issued before the blocks' backward is done."""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compose import fully_shard, fully_shard_root
from fsdp_compose.runtime.state import state_of
from tests._comm_counter import CollectiveCounter
from tests._training import (CFG, RECIPES, assert_parity, build_model, local_batch,
                             make_optimizer, train_reference, train_sharded)
from tests.harness import run_distributed


def _blocks_then_split_root(model, **kw):
    for block in model.blocks:
        fully_shard(block, **kw)
    return fully_shard_root(model, **kw)


def _train_split(optim_name):
    RECIPES.setdefault("split-root", _blocks_then_split_root)  # train_sharded reads it
    return train_sharded("split-root", optim_name)


@pytest.mark.parametrize("world,optim_name", [
    (2, "adamw"), pytest.param(3, "sgd", marks=pytest.mark.slow)])
def test_split_root_trains_like_one_process(world, optim_name):
    results = run_distributed(world, _train_split, optim_name)
    assert_parity(results, train_reference(world, optim_name))


class _OrderedCounter(CollectiveCounter):
    def __init__(self):
        super().__init__()
        self.order = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            out = args[0]
            self.order.append((str(func).split(".")[1],
                               out.numel() if isinstance(out, torch.Tensor) else 0))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _counted_step(bucket_cap_mb=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _blocks_then_split_root(build_model())
    if bucket_cap_mb is not None:
        model.set_bucket_cap_mb(bucket_cap_mb)
    optim = make_optimizer(model, "sgd")
    for step in range(3):
        x, y = local_batch(step, rank, world)
        counter = _OrderedCounter()
        with counter:
            model.loss(x, y).backward()
        optim.step()
        optim.zero_grad()
    units = {name: state_of(getattr(model, name)).unit for name in ("tok_emb", "head")}
    return {"order": counter.order, "root_buffers": len(state_of(model).unit.buffers),
            "head_shard": units["head"].buffers[0].layout.shard_numel,
            "block_shards": [state_of(b).unit.buffers[0].layout.shard_numel
                             for b in model.blocks],
            "same_unit": [state_of(model.pos_emb).unit is units["tok_emb"],
                          state_of(model.ln_f).unit is units["head"]]}


@pytest.mark.parametrize("bucketed", [False, True])
def test_split_root_counts_and_overlap(bucketed):
    result = run_distributed(2, _counted_step, None if bucketed else 0)[0]
    order, blocks = result["order"], CFG.n_layers
    names = [name for name, _ in order]
    assert result["root_buffers"] == 0 and result["same_unit"] == [True, True]
    # blocks twice (bucketed, by default: the blocks are one bucket, in
    # backward gathered block by block as the first bucket reached; the kept
    # embeddings and head never join one); the embeddings and the norm + head
    # once each (kept from forward to backward, as the root kept them); one
    # reduction per unit (per bucket)
    gathered = 1 if bucketed else blocks
    assert names.count("_allgather_base_") == gathered + blocks + 2
    assert names.count("_reduce_scatter_base_") == gathered + 2
    # the first reduction of backward is the head's (a single root's came last),
    # issued while the blocks' backward all-gathers are still to come
    reduces = [(i, size) for i, (name, size) in enumerate(order)
               if name == "_reduce_scatter_base_"]
    assert result["head_shard"] not in result["block_shards"]
    assert reduces[0][1] == result["head_shard"], order
    last_gather = len(names) - 1 - names[::-1].index("_allgather_base_")
    assert reduces[0][0] < last_gather, order


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4)])
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight


def _tied_is_not_split():
    model = _Tied()
    fully_shard(model.blocks[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fully_shard_root(model)
    return [str(w.message) for w in caught], state_of(model.emb) is None


def test_tied_parameters_keep_the_root_whole():
    for messages, whole in run_distributed(2, _tied_is_not_split):
        assert whole and any("not splitting" in m for m in messages), messages
