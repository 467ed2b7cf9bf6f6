"""Gradient clipping and per-parameter norms over sharded gradients.

Every check compares against torch on an unsharded single-process copy that
did the same forward/backward on the global batch (our gradients are means
over ranks of per-rank mean losses, which equals the global-batch mean).
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_compose import fully_shard, param_info
from fsdp_compose.gradients.clip import clip_grad_norm_, param_norms
from tests._comm_counter import CollectiveCounter
from tests._training import (_attr, assert_parity, build_model, global_batch, local_batch,
                             make_optimizer, shard_blocks_and_root)
from tests.harness import run_distributed

ALL_REDUCE = torch.ops.c10d.allreduce_.default
NORM_TYPES = [2.0, math.inf, 1.0, 3.0]
MAX_NORM = 0.05  # the GPT's gradient norms are far above this: clipping always bites


# ------------------------------------------------------------------ helpers
def _frozen(name: str) -> bool:
    return name.startswith("blocks.1.attn") or name == "pos_emb.weight"


def _gpt_with_frozen() -> nn.Module:
    model = build_model()
    for name, p in model.named_parameters():
        if _frozen(name):
            p.requires_grad_(False)
    return model


IGNORED = ("blocks.0.ln1.bias", "ln_f.weight")


def _annotate_with_ignored(model: nn.Module) -> None:
    for i, block in enumerate(model.blocks):
        fully_shard(block, ignored_params={block.ln1.bias} if i == 0 else None)
    fully_shard(model, ignored_params={model.ln_f.weight})



def _grad_pieces(model: nn.Module) -> dict:
    """name -> (offset, local grad) for sharded params, (None, full grad) for
    unmanaged ones, None where this rank has no grad."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            out[name] = None
            continue
        info = param_info(p)
        out[name] = (None if info is None else info.local_offset, p.grad.detach().clone())
    return out


def _assemble(per_rank_pieces: list, shapes: dict) -> dict:
    """Full gradients from every rank's pieces; checks each element of a
    sharded gradient comes from exactly one rank."""
    full = {}
    for name, shape in shapes.items():
        pieces = [r[name] for r in per_rank_pieces if r[name] is not None]
        if not pieces:
            full[name] = None
            continue
        if pieces[0][0] is None:  # unmanaged: replicated full gradient
            full[name] = pieces[0][1].view(shape)
            continue
        flat = torch.zeros(shape.numel())
        cover = torch.zeros(shape.numel(), dtype=torch.int64)
        for offset, g in pieces:
            flat[offset:offset + g.numel()] = g.reshape(-1)  # a local piece: rows or 1-D
            cover[offset:offset + g.numel()] += 1
        assert bool((cover == 1).all()), f"{name}: elements owned by {cover.unique().tolist()} ranks"
        full[name] = flat.view(shape)
    return full


def _counts(counter: CollectiveCounter) -> dict:
    return {str(k): v for k, v in counter.counts.items()}


# ----------------------------------------- GPT: norms, clipped grads, counts
def _clip_gpt_worker():
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _gpt_with_frozen()
    _annotate_with_ignored(model)
    assert {n for n, p in model.named_parameters() if param_info(p) is None} == set(IGNORED)
    x, y = local_batch(0, rank, world)
    model.loss(x, y).backward()
    params = dict(model.named_parameters())
    for name in IGNORED:  # not reduced by fully_shard: average them as a user would
        g = params[name].grad
        dist.all_reduce(g)
        g.div_(world)
    saved = {n: (p.grad.clone() if p.grad is not None else None) for n, p in params.items()}

    def restore():
        for n, p in params.items():
            if saved[n] is not None:
                p.grad.copy_(saved[n])

    out = {"norms": {}, "grads": {}, "counts": {}, "pnorms": {}, "pcounts": {}}
    for norm_type in NORM_TYPES:
        restore()
        with CollectiveCounter() as comm:
            total = clip_grad_norm_(model, MAX_NORM, norm_type)
        assert total.shape == () and total.dtype == torch.float32
        out["norms"][norm_type] = total
        out["counts"][norm_type] = _counts(comm)
        out["grads"][norm_type] = _grad_pieces(model)
    restore()
    for kind in ("grad", "weight"):
        for norm_type in (2.0, math.inf):
            with CollectiveCounter() as comm:
                by_name = param_norms(model, kind, norm_type)
            as_list = param_norms(list(model.parameters()), kind, norm_type)
            assert len(as_list) == len(by_name) and all(
                (a is None and b is None) or torch.equal(a, b)
                for a, b in zip(by_name.values(), as_list))
            out["pnorms"][(kind, norm_type)] = by_name
            out["pcounts"][(kind, norm_type)] = _counts(comm)
    out["saved"] = _grad_pieces(model)
    return out


def _reference_gpt(world):
    model = _gpt_with_frozen()
    x, y = global_batch(0, world, "plain")
    model.loss(x, y).backward()
    params = dict(model.named_parameters())
    saved = {n: (p.grad.clone() if p.grad is not None else None) for n, p in params.items()}
    ref = {"norms": {}, "grads": {}, "saved": saved, "pnorms": {}}
    for norm_type in NORM_TYPES:
        for n, p in params.items():
            if saved[n] is not None:
                p.grad.copy_(saved[n])
        ref["norms"][norm_type] = torch.nn.utils.clip_grad_norm_(
            model.parameters(), MAX_NORM, norm_type)
        ref["grads"][norm_type] = {n: (p.grad.clone() if p.grad is not None else None)
                                   for n, p in params.items()}
    for norm_type in (2.0, math.inf):
        ref["pnorms"][("grad", norm_type)] = {
            n: (None if g is None else torch.linalg.vector_norm(g, norm_type))
            for n, g in saved.items()}
        ref["pnorms"][("weight", norm_type)] = {
            n: torch.linalg.vector_norm(p.detach(), norm_type) for n, p in params.items()}
    shapes = {n: p.shape for n, p in params.items()}
    return ref, shapes


def _close(got, want, what):
    want = want.cpu() if isinstance(want, torch.Tensor) else want
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-7, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_clip_matches_unsharded_reference(world):
    results = run_distributed(world, _clip_gpt_worker)
    ref, shapes = _reference_gpt(world)
    # the gradients before clipping agree (the premise of every check below)
    before = _assemble([r["saved"] for r in results], shapes)
    for name, want in ref["saved"].items():
        if want is None:
            assert before[name] is None, f"{name} is frozen but has a gradient"
        else:
            _close(before[name], want, f"grad {name}")
    for norm_type in NORM_TYPES:
        for rank, res in enumerate(results):
            # bitwise the same total norm on every rank
            assert torch.equal(res["norms"][norm_type], results[0]["norms"][norm_type]), rank
            # exactly one all-reduce, nothing else (none at all on one rank)
            want_counts = {str(ALL_REDUCE): 1} if world > 1 else {}
            assert res["counts"][norm_type] == want_counts, (norm_type, res["counts"][norm_type])
        _close(results[0]["norms"][norm_type], ref["norms"][norm_type], f"norm {norm_type}")
        clipped = _assemble([r["grads"][norm_type] for r in results], shapes)
        for name, want in ref["grads"][norm_type].items():
            if want is None:
                assert clipped[name] is None
            else:
                _close(clipped[name], want, f"clipped grad {name} (norm {norm_type})")
    for key, want in ref["pnorms"].items():
        for rank, res in enumerate(results):
            got = res["pnorms"][key]
            assert got.keys() == want.keys()
            assert res["pcounts"][key] == ({str(ALL_REDUCE): 1} if world > 1 else {})
            for name, w in want.items():
                if w is None:
                    assert got[name] is None, (key, name)
                else:
                    _close(got[name], w, f"param norm {key} {name} on rank {rank}")


# ------------------------------ mixed dtypes, two process groups, empty shards
class _Holder(nn.Module):
    """Named children (a plain module: fully_shard rejects an nn.ModuleDict)."""

    def __init__(self, children: dict) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)

    def __getitem__(self, name: str) -> nn.Module:
        return getattr(self, name)


def _synthetic_model() -> nn.Module:
    torch.manual_seed(3)
    return _Holder({
        "a": nn.Linear(5, 3),
        "b": nn.Linear(3, 2).to(torch.bfloat16),   # its own dtype
        "c": nn.Linear(1, 1),                       # 2 elements: some ranks own none
        "d": nn.Linear(2, 2),                       # d.weight is ignored (replicated)
        "e": nn.Linear(2, 2),                       # frozen
    })


def _synthetic_grads(model: nn.Module) -> dict:
    g = torch.Generator().manual_seed(11)
    return {n: (torch.randn(p.shape, generator=g) * (1 + i)).to(p.dtype)
            for i, (n, p) in enumerate(model.named_parameters()) if not n.startswith("e.")}


def _synthetic_worker(norm_types):
    world = dist.get_world_size()
    model = _synthetic_model()
    model["e"].requires_grad_(False)
    full = _synthetic_grads(model)
    other = DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu")
    fully_shard(model["a"])
    fully_shard(model["b"], mesh=other)   # another process group over the same ranks
    fully_shard(model["c"])
    fully_shard(model, ignored_params={model["d"].weight})
    empty_somewhere = False
    for name, p in model.named_parameters():
        info = param_info(p)
        if name not in full:
            continue
        if info is None:
            p.grad = full[name].clone()
        elif info.local_numel:
            piece = full[name].reshape(-1)[info.local_offset:info.local_offset + info.local_numel]
            p.grad = piece.reshape(p.shape).clone()
        else:
            empty_somewhere = True
    saved = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    out = {"norms": {}, "counts": {}, "pnorms": {}, "empty": empty_somewhere}
    for norm_type in norm_types:
        for n, p in model.named_parameters():
            if n in saved:
                p.grad.copy_(saved[n])
        with CollectiveCounter() as comm:
            out["norms"][norm_type] = clip_grad_norm_(model.parameters(), 1e9, norm_type)
        out["counts"][norm_type] = _counts(comm)
        out["pnorms"][norm_type] = param_norms(model, "grad", norm_type)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_mixed_dtypes_groups_ignored_and_empty_shards(world):
    results = run_distributed(world, _synthetic_worker, NORM_TYPES)
    if world >= 3:
        assert any(r["empty"] for r in results), "the test should cover ranks owning nothing"
    full = _synthetic_grads(_synthetic_model())
    flat = torch.cat([g.double().reshape(-1) for g in full.values()])
    for norm_type in NORM_TYPES:
        want = torch.linalg.vector_norm(flat, norm_type).float()
        for res in results:
            assert torch.equal(res["norms"][norm_type], results[0]["norms"][norm_type])
            # two process groups with the same ranks are merged: still one all-reduce
            assert res["counts"][norm_type] == ({str(ALL_REDUCE): 1} if world > 1 else {})
            _close(res["norms"][norm_type], want, f"norm {norm_type}")
            for name, g in full.items():
                _close(res["pnorms"][norm_type][name],
                       torch.linalg.vector_norm(g.double(), norm_type).float(), name)
            assert res["pnorms"][norm_type]["e.weight"] is None


# ------------------------------------------------- non-finite, consistently
def _nonfinite_worker():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    fully_shard(model)
    model(torch.randn(3, 4)).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None and p.grad.numel()]
    saved = [g.clone() for g in grads]
    holding = [None] * world  # 16-byte aligned chunks: the last ranks may hold none of it
    dist.all_gather_object(holding, bool(grads))
    last = max(r for r in range(world) if holding[r])
    out = {}
    for bad in (math.inf, math.nan):
        def inject():
            for g, s in zip(grads, saved):
                g.copy_(s)
            if rank == last:
                grads[0].view(-1)[0] = bad          # only the last holding rank sees it
        inject()
        try:
            clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
            out[f"raised {bad}"] = False
        except RuntimeError as e:
            out[f"raised {bad}"] = "non-finite" in str(e)
        for norm_type in (2.0, math.inf, 1.0):
            inject()
            out[(str(bad), norm_type)] = clip_grad_norm_(model, 1.0, norm_type).item()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_nonfinite_is_seen_by_every_rank(world):
    for res in run_distributed(world, _nonfinite_worker):
        assert res["raised inf"] and res["raised nan"]
        assert res[("inf", 2.0)] == math.inf and res[("inf", math.inf)] == math.inf
        assert res[("inf", 1.0)] == math.inf
        for norm_type in (2.0, math.inf, 1.0):
            assert math.isnan(res[("nan", norm_type)]), norm_type


# ----------------------------------------------------- training parity
CLIP_STEPS = 3
TRAIN_MAX_NORM = 0.3


def _train_clipped_sharded():
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    shard_blocks_and_root(model)
    optim = make_optimizer(model, "adamw")
    losses, totals = [], []
    for step in range(CLIP_STEPS):
        x, y = local_batch(step, rank, world)
        loss = model.loss(x, y)
        loss.backward()
        totals.append(clip_grad_norm_(model, TRAIN_MAX_NORM).item())
        optim.step()
        optim.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    model.unshard(recurse=True)
    full = {n: _attr(model, n).detach().clone() for n, _ in model.named_parameters()}
    model.reshard(recurse=True)
    return {"losses": losses, "params": full, "evals": [], "totals": totals}


def _train_clipped_reference(world):
    model = build_model()
    optim = make_optimizer(model, "adamw")
    losses, totals = [], []
    for step in range(CLIP_STEPS):
        x, y = global_batch(step, world, "plain")
        loss = model.loss(x, y)
        loss.backward()
        totals.append(torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN_MAX_NORM).item())
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "evals": [], "totals": totals}


@pytest.mark.parametrize("world", [2, 4])
def test_training_with_clipping_matches_reference(world):
    results = run_distributed(world, _train_clipped_sharded)
    reference = _train_clipped_reference(world)
    assert all(t > TRAIN_MAX_NORM for t in reference["totals"]), "clipping must bite"
    assert_parity(results, reference, atol=1e-5)
    for res in results:
        assert res["totals"] == results[0]["totals"]
        for got, want in zip(res["totals"], reference["totals"]):
            assert abs(got - want) <= 1e-5 * max(1.0, want)


def test_bad_arguments():
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm_([], 1.0, norm_type=0)
    with pytest.raises(ValueError, match="kind"):
        param_norms([], kind="update")
    # no sharded parameter: plain local norm, like torch
    a, b = torch.ones(3, requires_grad=True), torch.ones(2, requires_grad=True)
    a.grad, b.grad = torch.full((3,), 2.0), torch.full((2,), -1.0)
    assert clip_grad_norm_([a, b], 100.0).item() == pytest.approx(math.sqrt(14.0))
    assert clip_grad_norm_(a, 100.0, math.inf).item() == 2.0
    assert [n.item() for n in param_norms([a, b], "grad", 1.0)] == [6.0, 2.0]
