"""Placements at run time: local shapes between iterations, ``.grad`` on
non-owners, and training parity against one process on the global batch
(fp32, SGD with momentum and AdamW, uneven shapes, world sizes 2 and 3).

Run: PYTHONPATH=$PWD python -m pytest -q tests/core/test_placements.py
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from fsdp_compose import Blocks, CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, param_info
from tests._training import (_attr, _local, _local_step, assert_parity, build_model,
                             cached_reference, global_batch, local_batch, make_optimizer)
from tests._models import WithUnused
from tests.harness import run_distributed

ATOL = 1e-5
PLACEMENTS = {  # name -> (unit placement, shard_placement_fn kind)
    "flat0": ("flat", None),
    "rows": ("rows", None),
    "blocks2": (Blocks(2), None),
    "owned": ("owned", None),
    "shard0": ("flat", "shard0"),
    "shard1": ("flat", "shard1"),
    "owned-matrices": ("rows", "owned-2d"),
}


def _placement_fn(kind):
    """Module-level choices (the harness pickles arguments, not lambdas)."""
    if kind is None:
        return None
    if kind == "shard0":
        return lambda p: Shard(0) if p.ndim >= 1 else None
    if kind == "shard1":  # FSDP2's MoE recipe: dim 1 where there is one
        return lambda p: Shard(1) if p.ndim == 2 else Shard(0)
    if kind == "owned-2d":
        return lambda p: "owned" if p.ndim == 2 else None
    raise ValueError(kind)


def shard_with(model: nn.Module, name: str, mixed: bool = False, mesh_shape=None,
               reshard=None, offload: bool = False) -> nn.Module:
    placement, kind = PLACEMENTS[name]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed else None
    mesh = None
    if mesh_shape is not None:  # (replicate, shard): HSDP
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, placement=placement, shard_placement_fn=_placement_fn(kind),
                    mp_policy=mp, mesh=mesh, reshard_after_forward=reshard,
                    offload_policy=CPUOffloadPolicy() if offload else None)
    fully_shard(model, placement=placement, shard_placement_fn=_placement_fn(kind), mp_policy=mp,
                mesh=mesh)
    return model


def _expected_local_ndim(name: str, full_ndim: int) -> int:
    if name == "flat0":
        return 1  # today's 1-D pieces
    if name == "shard0" or name == "shard1":
        return full_ndim
    return full_ndim if full_ndim else 1  # a 0-dim parameter stays flat


def train_placed(name: str, optim_name: str, steps: int = 3, mode: str = "plain",
                 mixed: bool = False, mesh_shape=None, reshard=None, offload: bool = False) -> dict:
    """Runs on every rank: the parity loop of tests/_training.py with a placement."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model("gpt")
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shard_with(model, name, mixed, mesh_shape, reshard, offload)
    optim = make_optimizer(model, optim_name)
    losses, local_shapes, grads_none = [], {}, {}
    for step in range(steps):
        x, y = global_batch(step, world, mode)
        model.zero_grad()
        loss = _local_step(model, _local(x, rank, world), _local(y, rank, world), mode,
                           False, optim)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    model.unshard(recurse=True)  # right after the step: nothing may read stale values
    full = {n: _attr(model, n).detach().float().clone() for n in full_shapes}
    model.reshard(recurse=True)
    # shapes between iterations, and which ranks got a .grad in the last backward
    x, y = global_batch(0, world, mode)
    optim.zero_grad(set_to_none=True)
    model.loss(_local(x, rank, world), _local(y, rank, world)).backward()
    for n, p in model.named_parameters():
        info = param_info(p)
        assert info.shape == full_shapes[n]
        local_shapes[n] = tuple(p.shape)
        grads_none[n] = p.grad is None
        if p.grad is not None:
            assert p.grad.shape == p.shape, n
        assert p.ndim == _expected_local_ndim(name, len(full_shapes[n])), (n, p.shape)
    optim.zero_grad(set_to_none=True)
    return {"losses": losses, "params": full, "evals": [], "local_shapes": local_shapes,
            "grads_none": grads_none, "full_shapes": full_shapes}


def _check_shapes(name: str, results: list[dict]) -> None:
    world = len(results)
    for n, shape in results[0]["full_shapes"].items():
        local = [r["local_shapes"][n] for r in results]
        if name in ("shard0", "shard1") and len(shape):
            d = 1 if name == "shard1" and len(shape) == 2 else 0
            expected = [tuple(c.shape) for c in torch.empty(shape).chunk(world, d)]
            expected += [tuple(shape[:d]) + (0,) + tuple(shape[d + 1:])] * (world - len(expected))
            assert local == expected, (n, local)
            continue
        if len(shape) == 0:
            continue
        assert all(s[1:] == shape[1:] for s in local), (n, local)  # whole rows
        assert sum(s[0] for s in local) == shape[0], (n, local)
        owned = name == "owned" or (name == "owned-matrices" and len(shape) == 2)
        if owned:
            assert sorted(s[0] for s in local)[:-1] == [0] * (world - 1), (n, local)
        for r, s in zip(results, local):  # holds none: .grad is None under "owned" only
            assert r["grads_none"][n] == (owned and s[0] == 0), (n, local)


@pytest.mark.parametrize("name", [n for n in PLACEMENTS if n != "flat0"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_parity_and_local_shapes(name, world, optim):
    results = run_distributed(world, train_placed, name, optim)
    assert_parity(results, cached_reference(world, optim, 3), ATOL)
    _check_shapes(name, results)


# ------------------------------------------------------------------- Muon
def _muon_and_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """The usual recipe, unchanged from one process: Muon on the matrices
    (``p.ndim == 2``, which placements other than "flat" keep), AdamW on the rest."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(matrices, lr=0.02, momentum=0.95, weight_decay=0.01),
            torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1)]


class _fp32_newton_schulz:
    """torch's Muon runs Newton-Schulz in bfloat16, which turns the last-bit
    differences of a reduce-scatter (another summation order than one
    process) into bf16 roundings (~2e-4 after 3 steps). To check parity at
    1e-5, both runs use the same iteration in fp32 (a copy of torch 2.13's with
    the cast removed); the stock one runs too, at a bf16 tolerance."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __enter__(self):
        from torch.optim import _muon
        self.saved = _muon._zeropower_via_newtonschulz
        if self.enabled:
            def fp32(grad, ns_coefficients, ns_steps, eps):
                a, b, c = ns_coefficients
                x = grad.float()
                if grad.size(0) > grad.size(1):
                    x = x.T
                x = x / x.norm().clamp(min=eps)
                for _ in range(ns_steps):
                    gram = x @ x.T
                    x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
                return x.T if grad.size(0) > grad.size(1) else x
            _muon._zeropower_via_newtonschulz = fp32
        return self

    def __exit__(self, *exc):
        from torch.optim import _muon
        _muon._zeropower_via_newtonschulz = self.saved


def train_muon(name: str, fp32_ns: bool, steps: int = 3) -> dict:
    with _fp32_newton_schulz(fp32_ns):
        return _train_muon(name, steps)


def _train_muon(name: str, steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model("gpt")
    shard_with(model, name)
    optims = _muon_and_adamw(model)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, world, "plain")
        loss = model.loss(_local(x, rank, world), _local(y, rank, world))
        loss.backward()
        for o in optims:
            o.step()
            o.zero_grad()
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    muon_states = len(optims[0].state)  # only for the matrices this rank owns
    model.unshard(recurse=True)
    full = {n: _attr(model, n).detach().clone() for n, _ in model.named_parameters()}
    model.reshard(recurse=True)
    return {"losses": [], "params": full, "evals": [], "muon_states": muon_states,
            "matrices": len(optims[0].param_groups[0]["params"])}


def muon_reference(world: int, fp32_ns: bool, steps: int = 3) -> dict:
    with _fp32_newton_schulz(fp32_ns):
        return _muon_reference(world, steps)


def _muon_reference(world: int, steps: int) -> dict:
    model = build_model("gpt")
    optims = _muon_and_adamw(model)
    for step in range(steps):
        x, y = global_batch(step, world, "plain")
        model.loss(x, y).backward()
        for o in optims:
            o.step()
            o.zero_grad()
    return {"losses": [], "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("name", ["owned-matrices", "owned"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("fp32_ns", [True, False])
def test_muon_on_owned_matrices_matches_one_process(name, world, fp32_ns):
    results = run_distributed(world, train_muon, name, fp32_ns)
    # stock Muon: five bf16 Newton-Schulz steps amplify last-bit gradient differences
    # into ~2e-3 on updates of ~0.02 per step (measured 1.7e-3 after 3 steps)
    assert_parity(results, muon_reference(world, fp32_ns), ATOL if fp32_ns else 5e-3)
    matrices = results[0]["matrices"]
    assert matrices == sum(1 for p in build_model("gpt").parameters() if p.ndim == 2)
    # every matrix has its Muon state on exactly one rank
    assert sum(r["muon_states"] for r in results) == matrices
    assert all(r["muon_states"] > 0 for r in results)


# ------------------------------------------------------------ state dicts
def _full_values(model: nn.Module) -> dict:
    model.unshard(recurse=True)
    try:
        return {n: _attr(model, n).detach().clone() for n, _ in model.named_parameters()}
    finally:
        model.reshard(recurse=True)


def _perturbed(name: str, seed: int) -> nn.Module:
    """A sharded model whose values differ from the seeded build's."""
    model = build_model("gpt")
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))
    return shard_with(model, name)


def save_and_load_across(saved_as: str, loaded_as: str) -> dict:
    """State dict under one placement (values checked against the model),
    loaded into a model under another (DTensors, then full tensors)."""
    source = _perturbed(saved_as, 1)
    state = source.state_dict()
    want = _full_values(source)
    placements = {}
    for key, value in state.items():
        placements[key] = tuple(value.placements)
        torch.testing.assert_close(value.full_tensor(), want[key], rtol=0, atol=0)
        assert tuple(value.shape) == tuple(want[key].shape)
    target = _perturbed(loaded_as, 2)
    target.load_state_dict(state)
    loaded = _full_values(target)
    other = _perturbed(loaded_as, 3)
    other.load_state_dict({k: v.full_tensor() for k, v in state.items()})
    return {"want": want, "loaded": loaded, "loaded_full": _full_values(other),
            "placements": {k: repr(v) for k, v in placements.items()}}


@pytest.mark.parametrize("saved_as,loaded_as", [("shard0", "rows"), ("rows", "owned"),
                                                ("owned", "shard0"), ("shard1", "rows"),
                                                ("rows", "shard1"), ("owned", "owned")])
def test_state_dict_in_fsdp2_layout_loads_under_another_placement(saved_as, loaded_as):
    for res in run_distributed(3, save_and_load_across, saved_as, loaded_as):
        for key, want in res["want"].items():
            torch.testing.assert_close(res["loaded"][key], want, rtol=0, atol=0)
            torch.testing.assert_close(res["loaded_full"][key], want, rtol=0, atol=0)
            expected = "(Shard(dim=1),)" if saved_as == "shard1" and want.ndim == 2 \
                else "(Shard(dim=0),)"
            assert res["placements"][key] == expected, (key, res["placements"][key])


def _adamw_step(model, optim, step):
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(step, world, "plain")
    model.loss(_local(x, rank, world), _local(y, rank, world)).backward()
    optim.step()
    optim.zero_grad()


def resume_under_another_placement(saved_as: str, loaded_as: str) -> dict:
    """Two AdamW steps under one placement, model and optimizer state dicts
    (torch FSDP2's layout), a third step there and, after loading both, under
    another placement: the two must agree."""
    from fsdp_compose.checkpoint import register_optimizer
    source = shard_with(build_model("gpt"), saved_as)
    optim = make_optimizer(source, "adamw")
    for step in range(2):
        _adamw_step(source, optim, step)
    # a copy: torch's load keeps the saved 'step' tensors, which the source's next step bumps
    model_state, optim_state = source.state_dict(), copy.deepcopy(optim.state_dict())
    kinds = sorted({repr(v.placements) for s in optim_state["state"].values()
                    for v in s.values() if isinstance(v, DTensor)})
    target = _perturbed(loaded_as, 5)
    target_optim = make_optimizer(target, "adamw")
    register_optimizer(target_optim)
    target.load_state_dict(model_state)
    target_optim.load_state_dict(optim_state)
    _adamw_step(source, optim, 2)
    _adamw_step(target, target_optim, 2)
    return {"source": _full_values(source), "target": _full_values(target), "kinds": kinds}


@pytest.mark.parametrize("saved_as,loaded_as", [("rows", "owned"), ("owned", "shard0"),
                                                ("shard1", "owned"), ("owned", "rows")])
def test_optimizer_state_round_trips_across_placements(saved_as, loaded_as):
    for res in run_distributed(3, resume_under_another_placement, saved_as, loaded_as):
        for key, want in res["source"].items():
            torch.testing.assert_close(res["target"][key], want, rtol=0, atol=1e-6)
        assert res["kinds"]


@pytest.mark.parametrize("name", ["rows", "owned", "shard1"])
@pytest.mark.parametrize("mode", ["accum-nosync", "accum-sync"])
def test_gradient_accumulation_with_and_without_sync(name, mode):
    results = run_distributed(3, train_placed, name, "sgd", 3, mode)
    assert_parity(results, cached_reference(3, "sgd", 3, mode), ATOL)


@functools.cache
def _mixed_precision_flat() -> list[dict]:
    """``test_mixed_precision_equals_flat``'s run under "flat", the same for
    every placement it is compared with: run once, only read."""
    return run_distributed(2, train_placed, "flat0", "adamw", 3, "accum-nosync", True)


@pytest.mark.parametrize("name", ["rows", "owned", "shard1"])
def test_mixed_precision_equals_flat(name):
    """bf16 compute, fp32 reduction: a placement moves where values live,
    not what is computed, so it trains exactly like "flat" (same all-gathered
    values, the same element-wise sums across ranks). Except ``Shard(1)``:
    its whole weight is a transposed view of a copy (``docs/design.md`` §9),
    and on some CPUs the bf16 matmul takes another kernel for it, which
    rounds a few elements differently (seen: 9 of 384 by one bf16 step,
    2**-10 here); the losses still agree to bf16 precision."""
    placed = run_distributed(2, train_placed, name, "adamw", 3, "accum-nosync", True)
    flat = _mixed_precision_flat()
    atol = 2.0 ** -9 if name == "shard1" else 0.0
    for got, want in zip(placed, flat):
        if name == "shard1":
            assert got["losses"] == pytest.approx(want["losses"], rel=2.0 ** -8)
        else:
            assert got["losses"] == want["losses"]
        for key, value in want["params"].items():
            torch.testing.assert_close(got["params"][key], value, rtol=0, atol=atol)


# ----------------------------------------------------------------- errors
class _WithScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.lin(x) * self.scale


def _error_of(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def bad_placements() -> dict:
    rank = dist.get_rank()
    out = {
        "shard_dim": _error_of(lambda: fully_shard(_WithScalar(), shard_placement_fn=lambda p:
                                                   Shard(2) if p.ndim == 2 else None)),
        "blocks": _error_of(lambda: fully_shard(_WithScalar(), placement=Blocks(0))),
        "scalar": _error_of(lambda: fully_shard(_WithScalar(), shard_placement_fn=lambda p:
                                                "owned" if p.ndim == 0 else None)),
        "unknown": _error_of(lambda: fully_shard(_WithScalar(), placement="diagonal")),
        "fn": _error_of(lambda: fully_shard(_WithScalar(), shard_placement_fn="rows")),
    }
    # a unit-wide placement leaves the scalar flat: it trains
    model = fully_shard(_WithScalar(), placement="owned")
    model(torch.ones(2, 4)).sum().backward()
    out["scalar_shape"] = tuple(model.scale.shape)
    # ranks that disagree on a placement raise together at the first forward
    model = fully_shard(_WithScalar(), placement="rows" if rank == 0 else "owned")
    out["disagree"] = _error_of(lambda: model(torch.ones(2, 4)))
    return out


def test_bad_placements_raise_naming_the_parameter():
    for rank, out in enumerate(run_distributed(2, bad_placements)):
        assert "'lin.weight'" in out["shard_dim"] and "Shard(2)" in out["shard_dim"]
        assert "Blocks(n) needs an integer n >= 1" in out["blocks"]
        assert "'scale' is 0-dim" in out["scalar"]
        assert "placement must be" in out["unknown"]
        assert "TypeError: shard_placement_fn must be a callable" in out["fn"]
        assert out["scalar_shape"] in ((1,), (0,))
        assert "ranks disagree" in out["disagree"] and "placements" in out["disagree"]


def scatter_from_rank0(name: str) -> dict:
    from fsdp_compose.checkpoint import scatter_full_state_dict
    reference = _perturbed("flat0", 7)  # any values: read back in full below
    want = _full_values(reference)
    model = _perturbed(name, 8)
    scatter_full_state_dict(model, want if dist.get_rank() == 0 else None, src=0)
    return {"want": want, "got": _full_values(model)}


@pytest.mark.parametrize("name", ["rows", "owned", "shard1"])
def test_scatter_full_state_dict_under_placements(name):
    for res in run_distributed(3, scatter_from_rank0, name):
        for key, want in res["want"].items():
            torch.testing.assert_close(res["got"][key], want, rtol=0, atol=0)


# ------------------------------------------------- assembled copies' memory
def _forward_tensor_bytes_after_forward(name: str) -> dict:
    """The blocks' parameters as forward read them (a ``Shard(d)`` piece
    separated from its others in the buffer is read as an assembled copy),
    and the bytes those tensors' storages hold once the whole forward ran
    (the blocks reshard after forward; autograd saved the copies); then
    backward and a step, and the same after the next forward. Also, during
    each block's forward, the bytes its gathered buffers hold where every
    parameter of the buffer is read from a copy (released once copied out)."""
    from fsdp_compose.runtime.state import state_of
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard_with(build_model("gpt"), name)
    optim = make_optimizer(model, "adamw")
    seen: dict[int, torch.Tensor] = {}
    copied = {"buffers": 0, "gathered_bytes": 0}

    def record(block, _args):
        for param_name, _ in block.named_parameters():
            tensor = _attr(block, param_name)
            seen[id(tensor)] = tensor
        for buffer in state_of(block).unit.buffers:
            if buffer._view_plan.copies_only:
                copied["buffers"] += 1
                copied["gathered_bytes"] += buffer.unsharded.untyped_storage().nbytes()
    for block in model.blocks:
        block.register_forward_pre_hook(record)
    held = []
    for step in range(2):
        seen.clear()
        x, y = local_batch(step, rank, world)
        loss = model.loss(x, y)
        held.append(sum(t.untyped_storage().nbytes() for t in seen.values()))
        loss.backward()
        optim.step()
        optim.zero_grad()
    return {"held": held, "read": len(seen), **copied}


@pytest.mark.parametrize("name", ["shard0", "shard1", "rows"])
def test_forward_tensors_of_a_resharded_unit_hold_no_memory_until_backward(name):
    # [Note: assembled copies]: a copy autograd saved is freed with the
    # reshard after forward, as the views of the unsharded buffer are, and
    # filled again by backward's all-gather (parity: test_parity_and_local_shapes;
    # reshard_after_forward=k, whose kept piece is read back from the copies:
    # test_hsdp_and_integer_reshard_after_forward)
    for res in run_distributed(2, _forward_tensor_bytes_after_forward, name):
        assert res["read"] > 0
        assert res["held"] == [0, 0], res
        # a buffer read only through copies frees its gathered values once copied out
        assert (res["buffers"] > 0) == (name != "rows"), res
        assert res["gathered_bytes"] == 0, res


# ------------------------------------------- meta-device init, HSDP, offload
def materialized_like_eager(name: str) -> dict:
    """A model built on the meta device, sharded under a placement and
    materialised, holds what an eager build holds; then it trains."""
    from fsdp_compose import materialize
    torch.manual_seed(1234)
    with torch.device("meta"):
        from fsdp_compose.testing import GPT
        from tests._training import CFG
        model = GPT(CFG)
    shard_with(model, name)
    torch.manual_seed(1234)
    materialize(model)
    got = _full_values(model)
    optim = make_optimizer(model, "sgd")
    _adamw_step(model, optim, 0)  # any optimizer: it must run on the materialised shards
    return {"got": got}


@pytest.mark.parametrize("name", ["rows", "owned", "shard1"])
def test_meta_init_and_materialize_equal_an_eager_build(name):
    torch.manual_seed(1234)
    from fsdp_compose.testing import GPT
    from tests._training import CFG
    want = {n: p.detach() for n, p in GPT(CFG).named_parameters()}
    for res in run_distributed(3, materialized_like_eager, name):
        for key, value in want.items():
            torch.testing.assert_close(res["got"][key], value, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["rows", pytest.param("owned", marks=pytest.mark.slow), "shard1"])
def test_hsdp_and_integer_reshard_after_forward(name):
    """4 ranks: a (2, 2) HSDP mesh (the placement applies within each shard
    group), then a 1-D mesh with reshard_after_forward=2."""
    reference = cached_reference(4, "sgd", 3)
    assert_parity(run_distributed(4, train_placed, name, "sgd", 3, "plain", False, (2, 2)),
                  reference, ATOL)
    assert_parity(run_distributed(4, train_placed, name, "sgd", 3, "plain", False, None, 2),
                  reference, ATOL)


def described(name: str) -> dict:
    from fsdp_compose import describe
    model = shard_with(build_model("gpt"), name)
    report = describe(model).to_dict()
    report["text"] = str(describe(model))
    # what this rank holds, read from the parameters themselves
    report["held"] = [[r.param.numel() for r in b.records] for b in _buffers(model)]
    return report


def _buffers(model: nn.Module) -> list:
    """Every flat buffer, in describe()'s unit order."""
    from fsdp_compose.runtime.state import units_below
    return [buffer for unit in units_below(model) for buffer in unit.buffers]


@pytest.mark.parametrize("name", ["owned", "shard1", "rows"])
def test_describe_reports_placed_layouts(name):
    results = run_distributed(2, described, name)
    for rank, report in enumerate(results):
        buffers = [b for u in report["units"] for b in u["buffers"]]
        assert all(b["unsharded_numel"] == b["numel"] + b["padding"] for b in buffers)
        assert all(b["shard_numel"] * 2 == b["unsharded_numel"] for b in buffers)
        params = [p for b in buffers for p in b["params"]]
        if name == "owned":  # every non-scalar parameter on exactly one rank
            assert all(len(p["owner_ranks"]) == 1 for p in params if p["numel"])
        # per-rank loads: what each rank's parameters hold, and the imbalance from them
        assert [sum(held) for held in report["held"]] == [b["rank_numels"][rank] for b in buffers]
        for b in buffers:
            loads = b["rank_numels"]
            assert sum(loads) == b["numel"]
            want = max(loads) * len(loads) / sum(loads) - 1 if sum(loads) else 0.0
            assert b["imbalance"] == pytest.approx(want)
        expected = {"owned": "owned", "shard1": "Shard(1)", "rows": "rows"}[name]
        assert any(p["placement"] == expected for p in params)
        assert f"placement {expected}" in report["text"] or \
            f", {expected}" in report["text"], report["text"]
        assert "the most loaded +" in report["text"]


def planned_and_allocated(name: str) -> dict:
    """This rank's shard bytes and trainable elements, as ``fully_shard``
    allocated them under placement ``name``."""
    model = shard_with(build_model("gpt"), name)
    buffers = _buffers(model)
    return {"shard_bytes": sum(b.layout.shard_numel * b.dtype.itemsize for b in buffers),
            "trainable": [sum(r.param.numel() for r in b.records)
                          for b in buffers if b.requires_grad]}


@pytest.mark.parametrize("name", ["rows", "owned", "owned-matrices", "shard1"])
def test_the_planner_lays_out_like_fully_shard(name):
    """``estimate_memory(placement=, shard_placement_fn=)`` plans the layouts
    ``fully_shard`` allocates: the same shard bytes per rank, and optimizer
    state for the most loaded rank of each buffer (AdamW: two moments)."""
    from fsdp_compose.tools.planner import estimate_memory
    placement, kind = PLACEMENTS[name]
    with torch.device("meta"):
        model = build_model("gpt")
    units = [*model.blocks, model]
    flat = estimate_memory(model, 3, units=units, placement="flat")
    est = estimate_memory(model, 3, units=units, placement=placement,
                          shard_placement_fn=_placement_fn(kind))
    results = run_distributed(3, planned_and_allocated, name)
    assert est.sharded_params == results[0]["shard_bytes"]
    if name != "shard1":  # (torch.chunk's pieces happen to load rank 0 as "flat" does here)
        assert (est.sharded_params, est.optimizer_state) != \
            (flat.sharded_params, flat.optimizer_state)  # the placement reached the planner
    most_loaded = [max(loads) for loads in zip(*(r["trainable"] for r in results))]
    params = len(list(model.parameters()))
    assert est.optimizer_state == 2 * 4 * sum(most_loaded) + 4 * params  # + AdamW's steps


def converted(name: str) -> dict:
    """``model.double()`` after sharding: the buffers are rebuilt in float64
    from the local pieces; shapes are kept and one step trains."""
    model = shard_with(build_model("gpt"), name)
    before = _full_values(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    model.double()
    after = _full_values(model)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes
    assert all(p.dtype == torch.float64 for p in model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(0, world, "plain")
    model.loss(_local(x, rank, world), _local(y, rank, world)).backward()
    assert all(p.grad is None or p.grad.shape == p.shape for p in model.parameters())
    return {"before": before, "after": after}


@pytest.mark.parametrize("name", ["rows", "owned", "shard1"])
def test_dtype_conversion_after_sharding(name):
    for res in run_distributed(3, converted, name):
        for key, value in res["before"].items():
            torch.testing.assert_close(res["after"][key], value.double(), rtol=0, atol=0)


def norms_under(name: str) -> dict:
    """clip_grad_norm_ and param_norms over a placed model, after one backward."""
    from fsdp_compose import clip_grad_norm_, param_norms
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard_with(build_model("gpt"), name)
    x, y = global_batch(0, world, "plain")
    model.loss(_local(x, rank, world), _local(y, rank, world)).backward()
    per_param = {k: float(v) for k, v in param_norms(model).items()}
    values = {k: float(v) for k, v in param_norms(model, kind="weight").items()}
    total = float(clip_grad_norm_(model, 0.05))
    clipped = {k: float(v) for k, v in param_norms(model).items()}
    return {"per_param": per_param, "values": values, "total": total, "clipped": clipped}


@pytest.mark.parametrize("name", ["rows", "owned", "shard1"])
def test_clip_grad_norm_and_param_norms(name):
    model = build_model("gpt")
    x, y = global_batch(0, 3, "plain")
    model.loss(x, y).backward()
    want = {n: float(p.grad.norm()) for n, p in model.named_parameters()}
    want_values = {n: float(p.detach().norm()) for n, p in model.named_parameters()}
    want_total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
    want_clipped = {n: float(p.grad.norm()) for n, p in model.named_parameters()}
    for res in run_distributed(3, norms_under, name):
        assert res["total"] == pytest.approx(want_total, rel=1e-5)
        for key in want:
            assert res["per_param"][key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
            assert res["values"][key] == pytest.approx(want_values[key], rel=1e-6), key
            assert res["clipped"][key] == pytest.approx(want_clipped[key], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("name", ["rows", "owned", pytest.param("shard1", marks=pytest.mark.slow)])
def test_cpu_offload_policy(name):
    """The blocks with CPUOffloadPolicy (on a CPU mesh its storage path:
    shards and gradients kept apart from the compute copies)."""
    results = run_distributed(2, train_placed, name, "adamw", 3, "plain", False, None, None, True)
    assert_parity(results, cached_reference(2, "adamw", 3), ATOL)


def _one_used_steps(model: nn.Module, optim, steps: range, rank: int, world: int) -> None:
    for step in steps:
        torch.manual_seed(100 + step)
        x = torch.randn(2 * world, 4)
        local = x if rank is None else x[2 * rank:2 * rank + 2]
        model(local).pow(2).mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=False)


def _one_used_sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = WithUnused(4, 3, 4)
    fully_shard(model.used, placement="owned")
    fully_shard(model.unused)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def saved_where_one_rank_holds_nothing() -> dict:
    """3 ranks, ``"owned"``: the used unit's weight and bias live on ranks 0
    and 1, so rank 2 holds none of the parameters that get gradients and has
    no optimizer state; torch's ``get_state_dict`` initialises it alone. The
    state saved must be one process's; a fresh model and optimizer loaded
    from it train on like one process."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_state_dict, set_state_dict)
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim = _one_used_sharded(seed=0)
    _one_used_steps(model, optim, range(2), rank, world)
    had_state = bool(optim.state)
    model_sd, optim_sd = get_state_dict(model, optim)
    steps = {k: float(v["step"]) for k, v in optim_sd["state"].items()}
    kept_state = bool(optim.state)
    fresh, fresh_optim = _one_used_sharded(seed=1)
    set_state_dict(fresh, fresh_optim, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(strict=False))  # `unused` never had state
    _one_used_steps(fresh, fresh_optim, range(2, 4), rank, world)
    full = {n: v.full_tensor() for n, v in get_model_state_dict(fresh).items()}
    return {"had_state": had_state, "kept_state": kept_state, "steps": steps, "full": full}


def test_a_rank_holding_nothing_trained_saves_and_resumes_like_one_process():
    results = run_distributed(3, saved_where_one_rank_holds_nothing)
    assert [r["had_state"] for r in results] == [True, True, False]
    assert results[2]["kept_state"] is False  # torch's initialisation there was undone
    for r in results:  # the same keys and step counts on every rank: the used unit's, 2 steps
        assert r["steps"] == {"used.weight": 2.0, "used.bias": 2.0}, r["steps"]
    torch.manual_seed(0)
    reference = WithUnused(4, 3, 4)
    optim = torch.optim.AdamW(reference.parameters(), lr=0.1)
    _one_used_steps(reference, optim, range(4), None, 3)
    for name, want in reference.state_dict().items():
        for r in results:
            torch.testing.assert_close(r["full"][name], want, rtol=0, atol=1e-6)
