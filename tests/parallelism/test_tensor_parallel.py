"""Composition with tensor parallelism on 4 CPU ranks (dp=2 x tp=2):
``parallelize_module(block, mesh["tp"], plan)`` then ``fully_shard(block,
mesh=mesh["dp"])``. Parity with one process training on the global batch,
collectives per mesh dim, clipping, state dicts on the (dp, tp) mesh, and
the combinations that raise.

Run: PYTHONPATH=. python -m pytest -q tests/parallelism/test_tensor_parallel.py
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_compose import fully_shard, materialize, param_info
from fsdp_compose.gradients.clip import clip_grad_norm_
from tests._comm_counter import CollectiveCounter
from tests._checkpointing import resume_through_dcp
from tests.harness import run_distributed

DIM, HEADS, HIDDEN, VOCAB, LAYERS, SEQ = 12, 2, 22, 19, 2, 5
"""Uneven-ish: every TP-sharded dim divides by tp=2, but the TP-local
parameters (6x12, 11x12, 12x11, ...) do not divide by dp=2 in numel or rows,
so the flat buffers are padded and dim-0 chunks are uneven."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.q = nn.Linear(DIM, DIM)
        # no key bias: attention is invariant to it, so its gradient is rounding
        # noise that Adam would amplify into different updates
        self.k = nn.Linear(DIM, DIM, bias=False)
        self.v = nn.Linear(DIM, DIM)
        self.o = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        # -1 heads: the TP-local number of heads (HEADS / tp) under ColwiseParallel
        q, k, v = (proj(h).view(b, t, -1, DIM // HEADS).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, block_class: type = Block) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(block_class() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(tokens).reshape(-1, VOCAB), targets.reshape(-1))


PLAN = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
        "o": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
"""Colwise weights and biases: Shard(0); Rowwise weights: Shard(1), their
biases Replicate (a TP-replicated DTensor parameter); the norms stay plain."""


def build_model(block_class: type = Block) -> Model:
    torch.manual_seed(0)
    model = Model(block_class)
    with torch.no_grad():  # LayerNorm's default ones/zeros would hide a wrong gradient
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_(1.0, 0.2)
                m.bias.normal_(0.0, 0.2)
    return model


def global_batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (2 * dp, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def make_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def shard_2d(model: Model, mesh, **kwargs) -> Model:
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], PLAN)
        fully_shard(block, mesh=mesh["dp"], **kwargs)
    fully_shard(model, mesh=mesh["dp"])
    return model


def _local(t: torch.Tensor, mesh) -> torch.Tensor:
    """This dp rank's slice of the global batch (both tp ranks: the same)."""
    dp, rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    return t.chunk(dp)[rank]


# ------------------------------------------------------------------ training
class DimCounter(CollectiveCounter):
    """Counts c10d ops per (op, mesh dim name) of the group they ran on."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.names = {tuple(sorted(dist.get_process_group_ranks(mesh.get_group(d)))): d
                      for d in mesh.mesh_dim_names}
        self.by_dim: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # ours are c10d ops; DTensor's are functional collectives (group by name)
        if func.namespace in ("c10d", "_c10d_functional"):
            ranks = _group_ranks(args)
            if ranks is not None:  # not wait_tensor and the like
                op = str(func).split(".")[1]
                self.by_dim[(op, self.names.get(ranks, "other"))] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def _group_ranks(args) -> Optional[tuple[int, ...]]:
    for arg in args:
        group = None
        if isinstance(arg, torch.ScriptObject):
            try:
                group = dist.ProcessGroup.unbox(arg)
            except RuntimeError:
                continue  # a ReduceOp
        elif isinstance(arg, str) and arg not in ("sum", "avg", "max", "min", "product"):
            group = dist.distributed_c10d._resolve_process_group(arg)
        if group is not None:
            return tuple(sorted(dist.get_process_group_ranks(group)))
    return None


def _train(optim_name: str, steps: int = 3, max_norm=None, count_step=None):
    mesh = _mesh()
    model = shard_2d(build_model(), mesh)
    return train_loop(model, mesh, optim_name, lambda t: _local(t, mesh), mesh["dp"].size(),
                      steps=steps, max_norm=max_norm, count_step=count_step)


def train_loop(model, mesh, optim_name: str, local, dp: int, *, steps: int = 3, max_norm=None,
               count_step=None, batch=None) -> dict:
    """Train ``model`` (annotated) ``steps`` steps on ``batch(step, dp)``
    (default :func:`global_batch`), each rank on ``local(rows)``; clip to
    ``max_norm``; count the collectives of step ``count_step`` per mesh dim.
    Returns the mean losses, the norms, the full parameters and the counts
    (shared by the TP, HSDP x TP and SequenceParallel tests)."""
    batch = batch or global_batch
    optim = make_optimizer(model, optim_name)
    losses, norms, counts = [], [], None
    for step in range(steps):
        x, y = batch(step, dp)
        counter = DimCounter(mesh) if step == count_step else None
        with counter if counter is not None else _null():
            loss = model.loss(local(x), local(y))
            loss.backward()
        if counter is not None:
            counts = dict(counter.by_dim)
        if max_norm is not None:
            norms.append(clip_grad_norm_(model, max_norm).item())
        optim.step()
        optim.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "params": full, "counts": counts}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def train_reference(optim_name: str, steps: int = 3, max_norm=None, dp: int = 2, *,
                    build=None, batch=None):
    """One process on the global batch (``build()`` default :func:`build_model`,
    ``batch`` default :func:`global_batch`)."""
    model = (build or build_model)()
    optim = make_optimizer(model, optim_name)
    losses, norms = [], []
    for step in range(steps):
        x, y = (batch or global_batch)(step, dp)
        # the mean of the dp ranks' mean losses (equal slices): the global mean
        loss = model.loss(x, y)
        loss.backward()
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _assert_parity(results, reference, atol=1e-5):
    for rank, res in enumerate(results):
        for key in ("losses", "norms"):
            for got, want in zip(res[key], reference[key]):
                assert abs(got - want) <= atol * max(1.0, abs(want)), \
                    f"rank {rank}: {key} {got} vs {want}"
        assert res["params"].keys() == reference["params"].keys()
        for name, want in reference["params"].items():
            diff = (res["params"][name] - want).abs().max().item()
            assert diff <= atol, f"rank {rank}: {name} differs by {diff}"


@functools.cache
def _counted_run(optim_name: str) -> list[dict]:
    """Three steps on 4 ranks, the collectives of the third (steady) step
    counted: one job serves the parity test and the counting test (callers
    only read the results)."""
    return run_distributed(4, _train, optim_name, count_step=2, timeout=120)


@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_parity_with_one_process(optim_name):
    _assert_parity(_counted_run(optim_name), train_reference(optim_name))


def test_clipping_matches_one_process():
    """max_norm below the norm, so every step clips: the norm counts TP-sharded
    pieces once per tp rank and TP-replicated / plain parameters once."""
    results = run_distributed(4, _train, "sgd", max_norm=0.5, timeout=120)
    reference = train_reference("sgd", max_norm=0.5)
    assert all(n > 0.5 for n in reference["norms"]), reference["norms"]
    _assert_parity(results, reference)


def test_collectives_run_over_their_mesh_dims():
    """Per step: FSDP's all-gathers (the blocks, one bucket by default, in
    forward, and each alone in backward, where it is the first bucket
    reached; the root once) and reduce-scatters (the bucket's
    and the root's) over the dp groups; TP's
    all-reduces (functional collectives) over the tp groups: the Rowwise
    outputs o and down in forward, and in backward the input gradient of
    each Colwise module (q, k, v, up: a Partial gradient made Replicate);
    the used flags once over dp."""
    for got in (c["counts"] for c in _counted_run("sgd")):
        assert got[("_allgather_base_", "dp")] == 2 + LAYERS, got
        assert got[("_reduce_scatter_base_", "dp")] == 2, got
        assert got[("allreduce_", "dp")] == 1, got  # the used flags
        assert got[("all_reduce", "tp")] == 6 * LAYERS, got
        assert {dim for _, dim in got} == {"dp", "tp"}, got


# ----------------------------------------------------------------- identity
def _identity_and_views():
    mesh = _mesh()
    model = build_model()
    parallelize_module(model.blocks[0], mesh["tp"], PLAN)
    names_before = [n for n, _ in model.named_parameters()]
    tp_names = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
    norm_weight = model.blocks[0].norm1.weight
    fully_shard(model.blocks[0], mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    params = dict(model.named_parameters())
    q = model.blocks[0].q
    out = {"names": list(params) == names_before,
           "plain_between": not any(isinstance(p, DTensor) for p in params.values()),
           # tensor-parallel parameters stay "flat" (1-D local pieces) under the
           # default placement; the others keep their ndim ("rows")
           "tp_one_dim": bool(tp_names) and all(params[n].dim() == 1 for n in tp_names),
           "others_keep_ndim": any(p.dim() == 2 for n, p in params.items() if n not in tp_names)
           and all(p.dim() == len(param_info(p).shape)
                   for n, p in params.items() if n not in tp_names),
           "norm_identity": params["blocks.0.norm1.weight"] is norm_weight}
    seen = {}

    def hook(module, args):
        seen["type"] = type(module.weight).__name__
        seen["placements"] = tuple(module.weight.placements)
        seen["shape"] = tuple(module.weight.shape)
        seen["local"] = tuple(module.weight.to_local().shape)

    handle = q.register_forward_pre_hook(hook)
    model.loss(*global_batch(0, 1)).backward()
    handle.remove()
    out["forward"] = seen
    out["after"] = type(q.weight).__name__
    return out


def test_tp_parameters_are_plain_shards_between_iterations_and_dtensors_in_forward():
    for res in run_distributed(4, _identity_and_views, timeout=90):
        assert res["names"] and res["plain_between"] and res["norm_identity"]
        assert res["tp_one_dim"] and res["others_keep_ndim"]
        assert res["forward"] == {"type": "DTensor", "placements": (Shard(0),),
                                  "shape": (DIM, DIM), "local": (DIM // 2, DIM)}, res
        assert res["after"] == "Parameter"


# ---------------------------------------------------------------- checkpoint
def _state_dict_placements():
    mesh = _mesh()
    model = shard_2d(build_model(), mesh)
    sd = model.state_dict()
    reference = build_model().state_dict()
    exact = all(torch.equal(sd[k].full_tensor(), v) for k, v in reference.items())
    meshes = {k: tuple(v.device_mesh.mesh_dim_names) for k, v in sd.items()}
    return {"exact": exact, "meshes": meshes,
            "placements": {k: tuple(v.placements) for k, v in sd.items()}}


def test_state_dict_uses_fsdp2_2d_placements():
    for res in run_distributed(4, _state_dict_placements, timeout=90):
        assert res["exact"]
        p, m = res["placements"], res["meshes"]
        assert p["blocks.0.q.weight"] == (_StridedShard(0, split_factor=2), Shard(0))
        assert p["blocks.0.q.bias"] == (_StridedShard(0, split_factor=2), Shard(0))
        assert p["blocks.0.o.weight"] == (Shard(0), Shard(1))
        assert p["blocks.0.o.bias"] == (Shard(0), Replicate())
        assert m["blocks.0.q.weight"] == ("dp", "tp")
        assert p["blocks.0.norm1.weight"] == (Shard(0),) and m["blocks.0.norm1.weight"] == ("dp",)


def _dcp_round_trip(root: str):
    mesh = _mesh()

    def build(seed):
        model = build_model()
        if seed:
            torch.manual_seed(seed)
            for p in model.parameters():
                p.data.normal_()
        model = shard_2d(model, mesh)
        return model, make_optimizer(model, "adamw")

    def step(model, optim, i):
        x, y = global_batch(i, 2)
        model.loss(_local(x, mesh), _local(y, mesh)).backward()
        optim.step()
        optim.zero_grad()

    model, fresh, osd = resume_through_dcp(build, step, root)
    placements = tuple(osd["state"]["blocks.0.q.weight"]["exp_avg"].placements)
    a = {k: v.full_tensor() for k, v in model.state_dict().items()}
    b = {k: v.full_tensor() for k, v in fresh.state_dict().items()}
    # full tensors in: the same values come back
    full = {k: v.clone() for k, v in a.items()}
    fresh.load_state_dict(full)
    c = {k: v.full_tensor() for k, v in fresh.state_dict().items()}
    return {"diff": max((a[k] - b[k]).abs().max().item() for k in a),
            "full_diff": max((a[k] - c[k]).abs().max().item() for k in a),
            "placements": placements}


def test_dcp_round_trip_continues_identically(tmp_path):
    for res in run_distributed(4, _dcp_round_trip, str(tmp_path / "ckpt"), timeout=120):
        assert res["diff"] == 0.0 and res["full_diff"] == 0.0, res
        assert res["placements"] == (_StridedShard(0, split_factor=2), Shard(0))


# -------------------------------------------------------------- unsupported
def _refused(case: str):
    mesh = _mesh()
    model = build_model()
    block = model.blocks[0]
    try:
        if case == "same-mesh":
            parallelize_module(block, mesh["dp"], PLAN)
            fully_shard(block, mesh=mesh["dp"])
        elif case == "overlapping-meshes":
            # other["a"] holds the ranks of mesh["dp"]: one dim would shard twice
            other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
            parallelize_module(block, other["a"], PLAN)
            fully_shard(block, mesh=mesh["dp"])
        elif case == "3d-mesh":
            cube = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("r", "s", "t"))
            parallelize_module(block, cube["t"], PLAN)
            fully_shard(block, mesh=cube)
    except (ValueError, NotImplementedError) as e:
        return str(e)
    return None


@pytest.mark.parametrize("case,words", [
    ("same-mesh", "same mesh"),
    ("overlapping-meshes", "cannot be combined with the data-parallel mesh"),
    ("3d-mesh", "mesh['dp_replicate', 'dp_shard']")])
def test_unsupported_combinations_raise_naming_them(case, words):
    """HSDP + TP, mp_policy and offload_policy with TP are supported now
    (tests/parallelism/test_hsdp_tp.py, tests/parallelism/test_tp_precision.py); what is left raises
    on every rank, naming the combination (and the parameter where one is
    known)."""
    for message in run_distributed(4, _refused, case, timeout=60):
        assert message is not None and words in message, message
        if case != "3d-mesh":  # a mesh is refused before any parameter is looked at
            assert "q.weight" in message, message


def _meta_init_bounds() -> dict:
    """Deferred init with TP: build on the meta device, parallelize, shard,
    materialize. Initialisers see the DTensors, so a Rowwise ``down``
    (TP-local in_features 11 of 22) draws within the global fan-in's bound
    ``1/sqrt(22)``, not the local one's ``1/sqrt(11)``."""
    mesh = _mesh()
    with torch.device("meta"):
        model = Model(Block)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], PLAN)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    torch.manual_seed(0)
    materialize(model)
    down = model.state_dict()["blocks.0.down.weight"].full_tensor()
    return {"max": down.abs().max().item(), "shape": tuple(down.shape)}


def test_meta_init_with_tensor_parallel_sees_global_fan_in():
    for res in run_distributed(4, _meta_init_bounds, timeout=90):
        assert res["shape"] == (DIM, HIDDEN)
        bound = HIDDEN ** -0.5
        assert 0.9 * bound < res["max"] <= bound, res
