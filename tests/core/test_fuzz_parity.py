"""Fuzzed training parity: random module trees, random annotations, random
policies, held to one process training on the global batch (fp32, 1e-5).

Run (CI budget, derandomized so every run draws the same examples)::

    PYTHONPATH=. python -m pytest -q tests/core/test_fuzz_parity.py

A larger budget, to hunt bugs (``FSDP_COMPOSE_FUZZ_SEED=N`` draws another
sequence than CI's derandomized one)::

    FSDP_COMPOSE_FUZZ_EXAMPLES=200 FSDP_COMPOSE_FUZZ_SEED=1 PYTHONPATH=. \
        python -m pytest -q tests/core/test_fuzz_parity.py

What one example draws (``FuzzSpec``): a tree of ``FuzzNode`` modules (nesting
depth 1-3) whose leaves are ``Linear`` (``D -> D`` residual or a ``D -> 1``
gate), ``Embedding`` (added to the hidden state), ``LayerNorm`` (maybe without
affine parameters) and ``Conv1d`` (odd kernel, same length) on a hidden width
``D`` of 1-6, so many parameters have fewer elements than the world size; each
node's call program (children called twice, children never called, children
skipped on odd steps, children called through ``torch.utils.checkpoint``);
frozen parameters; a ``Linear`` weight tied between two siblings of one unit;
composable ``checkpoint`` on some nodes (before or after ``fully_shard``); a
bottom-up set of ``fully_shard`` calls (sibling lists included, the root
always last) with random ``reshard_after_forward``; a ``PrefetchPolicy``, and
sometimes explicit prefetch targets (each unit the next annotated one);
world size 1-4, at 4 sometimes a 2-D ``(replicate, shard)`` mesh, ``(2, 2)``
(HSDP) or ``(4, 1)`` (replication), passed to every ``fully_shard``; an int
``reshard_after_forward=k`` dividing the shard-group size on some units;
the model built on the meta device and ``materialize``d (``eager_init``
reproduces the eager build's values from the seed, tied weights included);
SGD with momentum or AdamW with weight decay; ``zero_grad`` to ``None`` or
to zeros; one or two micro-batches per step (the first with gradient sync,
without it, or without it and kept unsharded); a ``no_grad`` forward
between steps; a child of the root applied again after the root's forward
(like a chunked loss calling ``lm_head``); a resume after some step: the
model's and optimizer's state dicts (torch's ``get_state_dict``, DTensors)
loaded with ``set_model_state_dict`` / ``set_optimizer_state_dict`` into a
fresh model and optimizer built from another seed, which trains on (the
optimizer load is not strict: parameters that never got a gradient have no
state; zero ``.grad`` left by ``zero_grad(set_to_none=False)`` is given back,
it is not part of a checkpoint). The model has no 0-dim parameters, whose
optimizer state the library refuses to checkpoint.

Checked against the reference at every step: the global mean loss (and the
``no_grad`` forward's); which parameters have ``.grad`` (``None`` or not) and
this rank's 1-D gradient slice against the matching slice of the reference's
full gradient; between steps (and after the resume), every unit back to
``IDLE``, no unsharded storage held and every module attribute the original
``nn.Parameter``; the parameters after the last step, the ranks of each
replica together holding every element exactly once.

Every failure found is kept below as an explicit regression spec.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Optional, Union

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_compose import Blocks, PrefetchPolicy, fully_shard, materialize, param_info
from fsdp_compose.runtime.owners import owner_of
from fsdp_compose.runtime.state import units_below
from fsdp_compose.runtime.training_state import TrainingState
from tests._owners import buffer_of
from tests.harness import run_distributed

ATOL = 1e-5  # fp32, as tests/core/test_parity.py
EXAMPLES = int(os.environ.get("FSDP_COMPOSE_FUZZ_EXAMPLES", "8"))
FRESH_SEED = os.environ.get("FSDP_COMPOSE_FUZZ_SEED")  # unset: derandomized (CI)
TIMEOUT = 120


# ===================================================================== spec
@dataclass(frozen=True)
class LeafSpec:
    """One ``nn`` leaf. ``kind``: linear / gate (Linear D->1) / embedding /
    layernorm / conv1d. ``size``: vocabulary or kernel size. ``frozen``:
    names of its parameters with ``requires_grad=False``."""

    kind: str
    bias: bool = True
    size: int = 0
    frozen: tuple[str, ...] = ()


@dataclass(frozen=True)
class CallSpec:
    """One call of child ``child`` in its parent's forward."""

    child: int
    odd_steps: bool = True  # False: skipped on odd steps (unused in that step)
    recompute: bool = False  # through torch.utils.checkpoint (use_reentrant=False)


@dataclass(frozen=True)
class NodeSpec:
    children: tuple[Union["NodeSpec", LeafSpec], ...]
    calls: tuple[CallSpec, ...]
    tie: Optional[tuple[int, int]] = None  # children[b].weight = children[a].weight (Linear)
    checkpoint: bool = False  # composable torch.distributed._composable.checkpoint


@dataclass(frozen=True)
class Annotation:
    """One ``fully_shard`` call: module paths (several: a sibling list)."""

    paths: tuple[str, ...]
    reshard_after_forward: Union[bool, int, None] = None  # an int divides the shard-group size
    placement: object = "flat"  # fully_shard(placement=...): "flat", "rows", Blocks(n), "owned"


@dataclass(frozen=True)
class FuzzSpec:
    seed: int
    world: int
    d: int  # hidden width
    seq: int
    per_rank: int  # samples per rank and step
    root: NodeSpec
    annotations: tuple[Annotation, ...]  # bottom-up, the root ("",) last
    prefetch: tuple[bool, bool, int, int] = (True, True, 2, 1)  # PrefetchPolicy fields
    checkpoint_after_shard: bool = False
    optim: str = "sgd"
    zero_to_none: bool = True
    steps: int = 3
    micro: int = 1  # micro-batches per step (per_rank is a multiple)
    accumulate: str = "sync"  # earlier micro-batches: sync / nosync / keep-unsharded (no sync)
    eval_between: bool = False  # a no_grad forward after each step
    outside_call: Optional[int] = None  # apply this child of the root again after its forward
    explicit_prefetch: bool = False  # set_modules_to_{forward,backward}_prefetch along annotations
    mesh: Optional[tuple[int, int]] = None  # a 2-D (replicate, shard) mesh for every fully_shard
    meta_init: bool = False  # build on the meta device, annotate, then materialize from the seed
    resume_after: Optional[int] = None  # after this step: state dicts into a fresh model + optimizer

    @property
    def shard_size(self) -> int:
        """F: the ranks one parameter is sharded over (the mesh's shard dim)."""
        return self.mesh[1] if self.mesh else self.world

    def replica_of(self, rank: int) -> int:
        """Which replica (row of the ``(replicate, shard)`` mesh) ``rank`` is in."""
        return rank // self.shard_size


# ==================================================================== model
class FuzzNode(nn.Module):
    """Children ``c0, c1, ...``; forward runs ``spec.calls`` on a hidden
    state ``h`` of shape (batch, seq, D), with ``tokens`` for embeddings."""

    def __init__(self, spec: NodeSpec, d: int) -> None:
        super().__init__()
        self.spec = spec
        for i, child in enumerate(spec.children):
            self.add_module(f"c{i}", FuzzNode(child, d) if isinstance(child, NodeSpec)
                            else _build_leaf(child, d))
        if spec.tie is not None:
            a, b = spec.tie
            getattr(self, f"c{b}").weight = getattr(self, f"c{a}").weight

    def forward(self, h: torch.Tensor, tokens: torch.Tensor, step: int) -> torch.Tensor:
        for call in self.spec.calls:
            if not call.odd_steps and step % 2 == 1:
                continue
            fn = functools.partial(self._apply_child, call.child, tokens=tokens, step=step)
            if call.recompute:
                h = torch.utils.checkpoint.checkpoint(fn, h, use_reentrant=False)
            else:
                h = fn(h)
        return h

    def _apply_child(self, i: int, h: torch.Tensor, tokens: torch.Tensor,
                     step: int) -> torch.Tensor:
        child = getattr(self, f"c{i}")
        spec = self.spec.children[i]
        if isinstance(spec, NodeSpec):
            return child(h, tokens, step)
        # Averages, not sums: a child may run ~100 times per forward, and
        # activations (and gradients) growing with the call count would put
        # fp32 rounding above the 1e-5 tolerance (they reached |h| ~ 10).
        if spec.kind == "linear":
            return 0.5 * (h + torch.tanh(child(h)))
        if spec.kind == "gate":
            return h * torch.sigmoid(child(h))
        if spec.kind == "embedding":
            return 0.5 * (h + torch.tanh(child(tokens % spec.size)))
        if spec.kind == "layernorm":
            return child(h)
        if spec.kind == "conv1d":
            return 0.5 * (h + torch.tanh(child(h.transpose(1, 2)).transpose(1, 2)))
        raise ValueError(spec.kind)


def _build_leaf(spec: LeafSpec, d: int) -> nn.Module:
    if spec.kind == "linear":
        return nn.Linear(d, d, bias=spec.bias)
    if spec.kind == "gate":
        return nn.Linear(d, 1, bias=spec.bias)
    if spec.kind == "embedding":
        return nn.Embedding(spec.size, d)
    if spec.kind == "layernorm":
        # eps well above fp32 noise: with D = 1-2 the variance can be ~0, and
        # eps=1e-5 then makes one ulp of the input move the loss by ~1e-5
        return nn.LayerNorm(d, eps=0.1, elementwise_affine=spec.bias)
    if spec.kind == "conv1d":
        return nn.Conv1d(d, d, spec.size, padding=spec.size // 2, bias=spec.bias)
    raise ValueError(spec.kind)


def build_model(spec: FuzzSpec, seed: Optional[int] = None, meta: bool = False) -> FuzzNode:
    """The same values on every rank and in the reference (seeded here);
    ``meta``: shapes only (``materialize`` draws the values later)."""
    torch.manual_seed(spec.seed if seed is None else seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = FuzzNode(spec.root, spec.d)
    for path, leaf in _leaves(spec.root):
        module = model.get_submodule(path)
        for name in leaf.frozen:
            param = getattr(module, name, None)
            if param is not None:  # a tied weight follows its owner's flag
                param.requires_grad_(False)
    return model


def _leaves(node: NodeSpec, prefix: str = ""):
    for i, child in enumerate(node.children):
        path = f"{prefix}c{i}"
        if isinstance(child, NodeSpec):
            yield from _leaves(child, path + ".")
        elif node.tie is None or i != node.tie[1]:
            yield path, child


def _tied_copies(node: NodeSpec, prefix: str = ""):
    """Paths of the leaves whose ``weight`` was replaced by a sibling's."""
    if node.tie is not None:
        yield f"{prefix}c{node.tie[1]}"
    for i, child in enumerate(node.children):
        if isinstance(child, NodeSpec):
            yield from _tied_copies(child, f"{prefix}c{i}.")


def eager_init(model: FuzzNode, spec: FuzzSpec):
    """``materialize``'s ``init_fn`` that reproduces the eager build (see
    [Note: initialising as if eagerly] in fsdp_compose/init.py): every
    leaf's ``reset_parameters()`` in construction order. A tied copy's
    constructor drew a weight that the tie then replaced: it draws again
    (same random stream) but keeps the shared weight its owner drew."""
    copies = {id(model.get_submodule(path)) for path in _tied_copies(spec.root)}

    def init(module: nn.Module) -> None:
        reset = getattr(module, "reset_parameters", None)
        if reset is None:
            return  # a FuzzNode: no parameters of its own
        if id(module) in copies:
            kept = module.weight.detach().clone()
            reset()
            module.weight.copy_(kept)
        else:
            reset()
    return init


def _nodes(node: NodeSpec, prefix: str = ""):
    yield prefix.rstrip("."), node
    for i, child in enumerate(node.children):
        if isinstance(child, NodeSpec):
            yield from _nodes(child, f"{prefix}c{i}.")


def global_batch(spec: FuzzSpec, step: int):
    g = torch.Generator().manual_seed(spec.seed * 100 + step)
    n = spec.world * spec.per_rank
    x = torch.randn(n, spec.seq, spec.d, generator=g)
    tokens = torch.randint(0, 1 << 20, (n, spec.seq), generator=g)
    y = torch.randn(n, spec.seq, spec.d, generator=g)
    return x, tokens, y


def make_optim(model: nn.Module, name: str) -> Optional[torch.optim.Optimizer]:
    params = list(model.parameters())  # frozen ones too: the optimizer skips them
    if not params:  # e.g. one LayerNorm without affine parameters
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _forward_loss(model: FuzzNode, spec: FuzzSpec, x, tokens, y, step: int) -> torch.Tensor:
    h = model(x, tokens, step)
    if spec.outside_call is not None:  # like a chunked loss calling lm_head itself
        h = model._apply_child(spec.outside_call, h, tokens, step)
    return ((h - y) ** 2).mean()


# ================================================================ training
def _apply_checkpoint(model: FuzzNode, spec: FuzzSpec) -> None:
    from torch.distributed._composable import checkpoint
    for path, node in _nodes(spec.root):
        if path and node.checkpoint:
            checkpoint(model.get_submodule(path))


def _check_idle(model: nn.Module, originals: dict[str, nn.Parameter], where: str) -> None:
    rank = dist.get_rank()
    for name, p in model.named_parameters():
        assert p is originals[name], f"rank {rank}: {name} is not the original parameter {where}"
    for unit in units_below(model):
        assert unit.training_state is TrainingState.IDLE, f"rank {rank}: {unit.name} {unit.training_state} {where}"
    for p in model.parameters():
        buffer = buffer_of(p)
        if buffer is not None and not buffer.aliased:
            held = buffer.unsharded.untyped_storage().nbytes()
            assert held == 0, f"rank {rank}: {param_info(p).fqn} unsharded ({held} B) {where}"


def build_sharded(spec: FuzzSpec, mesh: Optional[DeviceMesh], seed: int) -> FuzzNode:
    """Every rank: the model from ``seed`` (eagerly, or on the meta device
    then ``materialize``), checkpointed, annotated and prefetching as drawn."""
    model = build_model(spec, seed, meta=spec.meta_init)
    if not spec.checkpoint_after_shard:
        _apply_checkpoint(model, spec)
    for ann in spec.annotations:
        modules = [model.get_submodule(p) for p in ann.paths]
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh,
                    reshard_after_forward=ann.reshard_after_forward, placement=ann.placement)
    if spec.checkpoint_after_shard:
        _apply_checkpoint(model, spec)
    if spec.meta_init:
        torch.manual_seed(seed)  # the eager build's random stream, from the start
        materialize(model, init_fn=eager_init(model, spec))
    model.set_prefetch_policy(PrefetchPolicy(*spec.prefetch))
    if spec.explicit_prefetch:  # each unit prefetches the next annotated one (and back)
        firsts = [model.get_submodule(a.paths[0]) for a in spec.annotations]
        for before, after in zip(firsts, firsts[1:]):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
    return model


def resume_fresh(spec: FuzzSpec, mesh: Optional[DeviceMesh], model: FuzzNode,
                 optim: Optional[torch.optim.Optimizer]):
    """Every rank: ``model``'s and ``optim``'s state dicts (torch's DCP
    ``get_state_dict``: DTensors) loaded into a fresh model and optimizer
    built from another seed; returns them."""
    # torch initialises an optimizer without state by a zero-gradient step
    # (AdamW's `step` would then count one more step than the reference's):
    # until some parameter got a gradient there is no optimizer state to save.
    # Under "rows"/"owned" a rank holding none of the parameters that got
    # gradients has none while the others have some: the state is saved.
    anywhere = torch.tensor([int(optim is not None and bool(optim.state))])
    dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
    with_optim = bool(anywhere)
    if with_optim:
        model_sd, optim_sd = get_state_dict(model, optim)
    elif any(True for _ in model.parameters()):
        model_sd = get_model_state_dict(model)
    else:
        model_sd = None  # torch's state-dict API refuses a model without parameters
    fresh = build_sharded(spec, mesh, seed=spec.seed + 1)
    fresh_optim = make_optim(fresh, spec.optim)
    if model_sd is not None:
        set_model_state_dict(fresh, model_sd)
    if with_optim:  # not strict: parameters that never got a gradient have no state
        set_optimizer_state_dict(fresh, fresh_optim, optim_sd,
                                 options=StateDictOptions(strict=False))
    # .grad is not checkpointed; zero_grad(set_to_none=False) left zeros that
    # the next step's optimizer applies (momentum, weight decay): give them back
    fresh_params = dict(fresh.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is not None:
            fresh_params[name].grad = torch.zeros_like(fresh_params[name])
    return fresh, fresh_optim


def train_sharded(spec: FuzzSpec) -> dict:
    """Runs on every rank: per-step global losses and gradient pieces, the
    final parameter pieces (``(local_offset, 1-D tensor)``)."""
    rank = dist.get_rank()
    mesh = None if spec.mesh is None else \
        init_device_mesh("cpu", spec.mesh, mesh_dim_names=("replicate", "shard"))
    model = build_sharded(spec, mesh, spec.seed)
    originals = dict(model.named_parameters())
    optim = make_optim(model, spec.optim)
    per = spec.per_rank
    losses, grads, evals = [], [], []
    for step in range(spec.steps):
        x, tokens, y = (t[rank * per:(rank + 1) * per] for t in global_batch(spec, step))
        loss = torch.zeros((), dtype=torch.float64)
        for i, (xm, tm, ym) in enumerate(zip(*(t.chunk(spec.micro) for t in (x, tokens, y)))):
            last = i == spec.micro - 1
            if spec.accumulate != "sync":
                model.set_requires_gradient_sync(last)
            if spec.accumulate == "keep-unsharded":
                model.set_reshard_after_backward(last)
            part = _forward_loss(model, spec, xm, tm, ym, step) / spec.micro
            if part.requires_grad:
                part.backward()
            loss += part.detach().double()
        grads.append({n: None if p.grad is None else
                      (param_info(p).local_offset, p.grad.detach().clone())
                      for n, p in model.named_parameters()})
        if optim is not None:
            optim.step()
            optim.zero_grad(set_to_none=spec.zero_to_none)
        _check_idle(model, originals, f"after step {step}")
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
        if spec.eval_between:
            with torch.no_grad():
                out = _forward_loss(model, spec, x, tokens, y, step).double()
            _check_idle(model, originals, f"after the no_grad forward of step {step}")
            dist.all_reduce(out, op=dist.ReduceOp.AVG)
            evals.append(out.item())
        if step == spec.resume_after:
            model, optim = resume_fresh(spec, mesh, model, optim)
            originals = dict(model.named_parameters())
            _check_idle(model, originals, f"after resuming from the state dicts of step {step}")
    params = {n: (param_info(p).local_offset, p.detach().clone())
              for n, p in model.named_parameters()}
    flat = {n: buffer_of(p).layout.placements[owner_of(p).index] == "flat"
            for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "evals": evals, "flat": flat}


def train_reference(spec: FuzzSpec) -> dict:
    model = build_model(spec)
    optim = make_optim(model, spec.optim)
    losses, grads, evals = [], [], []
    for step in range(spec.steps):
        x, tokens, y = global_batch(spec, step)
        loss = _forward_loss(model, spec, x, tokens, y, step)
        if loss.requires_grad:
            loss.backward()
        grads.append({n: None if p.grad is None else p.grad.detach().clone()
                      for n, p in model.named_parameters()})
        if optim is not None:
            optim.step()
            optim.zero_grad(set_to_none=spec.zero_to_none)
        losses.append(loss.item())
        if spec.eval_between:
            with torch.no_grad():
                evals.append(_forward_loss(model, spec, x, tokens, y, step).item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "evals": evals}


def _assert_piece(what: str, piece: tuple[int, torch.Tensor], full: torch.Tensor,
                  flat: bool = True) -> None:
    """``piece``: 1-D under ``"flat"``; under the other drawn placements
    (whole rows) the parameter's number of dimensions, contiguous."""
    offset, local = piece
    if flat:
        assert local.dim() == 1, f"{what}: local piece has shape {tuple(local.shape)}"
    else:
        assert local.shape[1:] == full.shape[1:], \
            f"{what}: local piece has shape {tuple(local.shape)}, the parameter {tuple(full.shape)}"
        local = local.reshape(-1)
    want = full.reshape(-1)[offset:offset + local.numel()] if local.numel() else full.new_empty(0)
    assert local.shape == want.shape, f"{what}: {local.numel()} elements at {offset} " \
                                      f"of {full.numel()}"
    if local.numel():
        diff = (local.double() - want.double()).abs().max().item()
        assert diff <= ATOL, f"{what} differs from the reference by {diff:.3g}"


def check_parity(spec: FuzzSpec) -> None:
    results = run_distributed(spec.world, train_sharded, spec, timeout=TIMEOUT)
    ref = train_reference(spec)
    for rank, res in enumerate(results):
        for step, (got, want) in enumerate(zip(res["losses"], ref["losses"])):
            assert abs(got - want) <= ATOL, f"rank {rank} step {step}: loss {got} vs {want}"
        for step, (got, want) in enumerate(zip(res["evals"], ref["evals"], strict=True)):
            assert abs(got - want) <= ATOL, f"rank {rank} step {step}: eval loss {got} vs {want}"
        for step, (got, want) in enumerate(zip(res["grads"], ref["grads"])):
            assert got.keys() == want.keys()
            for name, full in want.items():
                what = f"rank {rank} step {step}: {name}.grad"
                flat, held = res["flat"][name], res["params"][name][1].numel()
                if got[name] is None and full is not None and not flat and not held:
                    continue  # a rank holding none of a non-flat parameter gets no .grad
                assert (got[name] is None) == (full is None), \
                    f"{what} is {'None' if got[name] is None else 'set'}, reference " \
                    f"{'None' if full is None else 'set'}"
                if full is not None:
                    _assert_piece(what, got[name], full, flat)
        for name, full in ref["params"].items():
            _assert_piece(f"rank {rank}: parameter {name}", res["params"][name], full,
                          res["flat"][name])
    # the ranks of each replica together hold every element exactly once
    for replica in range(spec.world // spec.shard_size):
        ranks = [r for r in range(spec.world) if spec.replica_of(r) == replica]
        for name, full in ref["params"].items():
            pieces = sorted((results[r]["params"][name][0], results[r]["params"][name][1].numel())
                            for r in ranks)
            end = 0
            for offset, numel in pieces:
                assert numel == 0 or offset == end, \
                    f"{name}: ranks {ranks} hold [{offset}, {offset + numel}) after [0, {end})"
                end += numel
            assert end == full.numel(), f"{name}: ranks {ranks} hold {end} of {full.numel()}"


# ================================================================ strategy
LEAF_KINDS = ("linear", "gate", "embedding", "layernorm", "conv1d")
PARAM_NAMES = {"linear": ("weight", "bias"), "gate": ("weight", "bias"), "embedding": ("weight",),
               "layernorm": ("weight", "bias"), "conv1d": ("weight", "bias")}


@st.composite
def leaf_specs(draw) -> LeafSpec:
    kind = draw(st.sampled_from(LEAF_KINDS))
    sizes = {"embedding": st.integers(1, 7), "conv1d": st.sampled_from([1, 3])}
    size = draw(sizes[kind]) if kind in sizes else 0
    frozen = tuple(n for n in PARAM_NAMES[kind] if draw(st.integers(0, 6)) == 0)
    return LeafSpec(kind, bias=draw(st.booleans()), size=size, frozen=frozen)


@st.composite
def node_specs(draw, depth: int) -> NodeSpec:
    n = draw(st.integers(1, 3))
    children = tuple(draw(node_specs(depth - 1)) if depth > 1 and draw(st.booleans())
                     else draw(leaf_specs()) for _ in range(n))
    linears = [i for i, c in enumerate(children) if isinstance(c, LeafSpec) and c.kind == "linear"]
    tie = None
    if len(linears) >= 2 and draw(st.integers(0, 2)) == 0:
        tie = (linears[0], linears[1])
    order = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n + 2))
    calls = tuple(CallSpec(i, odd_steps=draw(st.integers(0, 4)) > 0,
                           recompute=draw(st.integers(0, 6)) == 0) for i in order)
    return NodeSpec(children, calls, tie, checkpoint=draw(st.integers(0, 5)) == 0)


def _modules_post_order(node: NodeSpec, prefix: str = ""):
    """(path, parent path) of every module below ``node``, children first;
    tied leaves are left out (they may not be separate units)."""
    tied = set(node.tie) if node.tie else set()
    for i, child in enumerate(node.children):
        path = f"{prefix}c{i}"
        if isinstance(child, NodeSpec):
            yield from _modules_post_order(child, path + ".")
        if i not in tied:
            yield path, prefix.rstrip(".")


@st.composite
def fuzz_specs(draw) -> FuzzSpec:
    world = draw(st.sampled_from([1, 2, 2, 3, 3, 4]))
    mesh = draw(st.sampled_from([None, (2, 2), (4, 1)])) if world == 4 else None
    shard_size = mesh[1] if mesh else world
    root = draw(node_specs(draw(st.integers(1, 3))))
    chosen = [(path, parent) for path, parent in _modules_post_order(root)
              if draw(st.booleans())]
    # an int k dividing the shard-group size F: 1 is False, F is True, 1 < k < F
    # keeps the parameters sharded over groups of k ranks between forward and backward
    divisors = [k for k in range(1, shard_size + 1) if shard_size % k == 0] \
        if shard_size > 1 else []
    raf = st.sampled_from([None, True, False, *divisors])
    placements = st.sampled_from(["flat", "flat", "rows", Blocks(2), "owned"])
    annotations: list[Annotation] = []
    pending: dict[str, str] = {}  # parent -> a chosen child kept back to join a sibling list
    for path, parent in chosen:
        if parent in pending:
            annotations.append(Annotation((pending.pop(parent), path), draw(raf),
                                          draw(placements)))
        elif draw(st.integers(0, 3)) == 0:
            pending[parent] = path
        else:
            annotations.append(Annotation((path,), draw(raf), draw(placements)))
    annotations += [Annotation((p,), draw(raf), draw(placements))
                    for p in pending.values()]  # found no sibling
    # deeper first is bottom-up (a stable sort keeps post-order within a depth)
    annotations.sort(key=lambda a: -a.paths[0].count("."))
    annotations.append(Annotation(("",), draw(raf), draw(placements)))
    micro = draw(st.integers(1, 2))
    steps = draw(st.integers(2, 3))
    return FuzzSpec(
        seed=draw(st.integers(0, 10_000)),
        world=world,
        d=draw(st.integers(1, 6)),
        seq=draw(st.integers(1, 3)),
        per_rank=micro * draw(st.integers(1, 2)),
        root=root,
        annotations=tuple(annotations),
        prefetch=(draw(st.booleans()), draw(st.booleans()), draw(st.integers(1, 3)),
                  draw(st.integers(1, 2))),
        checkpoint_after_shard=draw(st.booleans()),
        optim=draw(st.sampled_from(["sgd", "adamw"])),
        zero_to_none=draw(st.booleans()),
        steps=steps,
        micro=micro,
        accumulate=draw(st.sampled_from(["sync", "nosync", "keep-unsharded"])) if micro > 1
        else "sync",
        eval_between=draw(st.integers(0, 3)) == 0,
        # only a child with its own unit: the root's parameters are sharded after its forward
        outside_call=draw(st.sampled_from([None, None, *(
            i for i in range(len(root.children))
            if any(f"c{i}" in a.paths for a in annotations))])),
        explicit_prefetch=draw(st.integers(0, 3)) == 0,
        mesh=mesh,
        meta_init=draw(st.integers(0, 3)) == 0,
        # a later step must follow (it trains the fresh model)
        resume_after=draw(st.sampled_from([None, None, *range(steps - 1)])),
    )


@settings(max_examples=EXAMPLES, deadline=None, derandomize=FRESH_SEED is None,
          database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=fuzz_specs())
@(seed(int(FRESH_SEED)) if FRESH_SEED is not None else (lambda f: f))
def test_fuzzed_parity(spec: FuzzSpec) -> None:
    check_parity(spec)


# ======================================================= regression specs
# Each failure the fuzzer found, written out.
FROZEN = ("weight", "bias")


def _ln(frozen=FROZEN, bias=True) -> LeafSpec:
    return LeafSpec("layernorm", bias=bias, frozen=frozen)


def _even_steps(child: int, times: int = 1, recompute: bool = False) -> tuple[CallSpec, ...]:
    """``times`` calls of ``child``, each skipped on odd steps."""
    return (CallSpec(child, odd_steps=False, recompute=recompute),) * times


# A frozen Linear under composable checkpoint, recomputed in backward
_FROZEN_RECOMPUTED = NodeSpec((LeafSpec("linear", frozen=FROZEN),), _even_steps(0, recompute=True),
                              checkpoint=True)


REGRESSIONS = [
    # World size 1, forward prefetch: a unit prefetched from the previous
    # order that does not run this step (c0.c0 runs on even steps only) kept
    # its module attributes pointing at the full views after the forward
    # (the root dropped only prefetches still gathering; over one rank a
    # "prefetch" is just the attribute swap), so c0.c0.weight was a plain
    # tensor with .grad None instead of the parameter with zeroed .grad.
    pytest.param(FuzzSpec(
        seed=1, world=1, d=1, seq=1, per_rank=1,
        root=NodeSpec(
            children=(NodeSpec((LeafSpec("embedding", bias=False, size=6),),
                               (CallSpec(0, odd_steps=False),)),
                      NodeSpec((LeafSpec("linear", bias=False, frozen=("bias",)),
                                LeafSpec("linear", bias=False, frozen=("weight", "bias")),
                                LeafSpec("linear", bias=False)),
                               (CallSpec(0, odd_steps=False, recompute=True),)),
                      LeafSpec("linear", bias=False, frozen=("bias",))),
            calls=(CallSpec(0, odd_steps=False),), checkpoint=True),
        annotations=(Annotation(("c1.c0", "c1.c2")), Annotation(("c0.c0",)), Annotation(("",))),
        prefetch=(True, False, 1, 1), checkpoint_after_shard=True, zero_to_none=False),
        id="world1-unused-prefetch-keeps-views"),
    # The same bug with a frozen unit: param_info() of the left-over view was None.
    pytest.param(FuzzSpec(
        seed=3763, world=1, d=3, seq=1, per_rank=2,
        root=NodeSpec(
            children=(_ln(), LeafSpec("conv1d", bias=False, size=3, frozen=("weight", "bias")),
                      LeafSpec("conv1d", size=1, frozen=("weight",))),
            calls=tuple(CallSpec(i, odd_steps=False, recompute=True) for i in (1, 2, 2, 0, 0))),
        annotations=(Annotation(("c1",)), Annotation(("",))),
        prefetch=(True, False, 1, 2), checkpoint_after_shard=True, steps=2, eval_between=True),
        id="world1-unused-frozen-prefetch"),
    # LayerNorm over D=2 with eps=1e-5 (before the model used eps=0.1): one
    # ulp of a parameter moved the loss by 4.5e-6, so the sharded forward's
    # last-bit differences exceeded 1e-5 (a conditioning problem of the test
    # model, not a library bug; kept to hold the better-conditioned model).
    pytest.param(FuzzSpec(
        seed=3762, world=3, d=2, seq=1, per_rank=1,
        root=NodeSpec(
            children=(_ln(bias=False), LeafSpec("conv1d", bias=False, size=1,
                                                frozen=("weight", "bias")),
                      LeafSpec("linear", frozen=("weight",))),
            calls=tuple(CallSpec(i, odd_steps=False, recompute=True) for i in (2, 2, 2, 0)),
            checkpoint=True),
        annotations=(Annotation(("",)),), prefetch=(False, False, 1, 1), zero_to_none=False,
        steps=2, eval_between=True),
        id="layernorm-d2-conditioning-grad"),
    pytest.param(FuzzSpec(
        seed=3763, world=4, d=2, seq=2, per_rank=2,
        root=NodeSpec(
            children=(_ln(bias=False), _ln(frozen=("weight",), bias=False),
                      LeafSpec("conv1d", size=1, frozen=("weight",))),
            calls=tuple(CallSpec(i, odd_steps=False, recompute=True) for i in (2, 2, 2, 0)),
            checkpoint=True),
        annotations=(Annotation(("",)),), prefetch=(False, False, 1, 1), zero_to_none=False,
        steps=2, eval_between=True),
        id="layernorm-d2-conditioning-loss"),
    # Residual sums (before the model averaged): children called up to ~100
    # times grew |h| to ~10 and gradients to ~75, where fp32 rounding alone
    # (1-2 ulps) exceeds 1e-5 (conditioning of the test model, not a bug).
    pytest.param(FuzzSpec(
        seed=120, world=2, d=6, seq=3, per_rank=4,
        root=NodeSpec(
            children=(
                LeafSpec("linear", frozen=FROZEN),
                NodeSpec(children=(
                    _FROZEN_RECOMPUTED,
                    NodeSpec((LeafSpec("embedding", size=5, frozen=("weight",)),
                              LeafSpec("linear", frozen=("weight",)), LeafSpec("layernorm")),
                             (CallSpec(1), CallSpec(1, odd_steps=False))),
                    NodeSpec((LeafSpec("embedding", size=3), LeafSpec("linear", bias=False),
                              LeafSpec("conv1d", size=1)),
                             (CallSpec(1, recompute=True), CallSpec(1), CallSpec(2)))),
                    calls=(CallSpec(2), CallSpec(1, odd_steps=False, recompute=True)),
                    checkpoint=True)),
            calls=(CallSpec(1), CallSpec(1)) + _even_steps(1, 2),
            checkpoint=True),
        annotations=(Annotation(("c1.c1.c0",), True), Annotation(("c1.c1.c1",)),
                     Annotation(("c1.c1.c2",)), Annotation(("c1.c2.c0",)),
                     Annotation(("c1.c2.c1", "c1.c2.c2")), Annotation(("c1.c0.c0",), False),
                     Annotation(("c1.c0",)), Annotation(("c1.c2",)), Annotation(("c0",), True),
                     Annotation(("",))),
        prefetch=(False, False, 2, 2), checkpoint_after_shard=True, zero_to_none=False,
        micro=2, accumulate="nosync"),
        id="growing-activations-grad"),
    pytest.param(FuzzSpec(
        seed=0, world=2, d=3, seq=1, per_rank=1,
        root=NodeSpec(
            children=(
                LeafSpec("linear", bias=False, frozen=FROZEN),
                NodeSpec(children=(
                    _FROZEN_RECOMPUTED,
                    NodeSpec((LeafSpec("embedding", bias=False, size=1, frozen=("weight",)),
                              LeafSpec("linear", bias=False, frozen=FROZEN),
                              LeafSpec("gate", bias=False, frozen=FROZEN)),
                             _even_steps(0, 5, recompute=True), checkpoint=True),
                    LeafSpec("embedding", bias=False, size=1, frozen=("weight",))),
                    calls=_even_steps(0, 5, recompute=True), checkpoint=True)),
            calls=_even_steps(0, 2, recompute=True) + _even_steps(1, 2, recompute=True),
            checkpoint=True),
        annotations=(Annotation(("",)),), prefetch=(False, False, 1, 1), zero_to_none=False,
        steps=2, eval_between=True, explicit_prefetch=True),
        id="growing-activations-loss"),
    # Deferred init of a sibling-list unit: the root's to_empty() recursed into
    # c0's ShardedModule._apply, which rebuilt the unit [c0, c1] while c1 was
    # still on the meta device and raised (model.double() alike). Fixed: a
    # nested _apply leaves the rebuild to the outermost one.
    pytest.param(FuzzSpec(
        seed=0, world=1, d=1, seq=1, per_rank=1,
        root=NodeSpec(children=(LeafSpec("linear", bias=False), LeafSpec("gate", bias=False)),
                      calls=(CallSpec(0),)),
        annotations=(Annotation(("c0", "c1")), Annotation(("",))), meta_init=True),
        id="meta-init-sibling-list"),
    # A no_grad forward calling c1, c0.c0, c1 with forward prefetch: c1's second
    # call prefetched c0.c0 (after c1 in the last order) although c0.c0 had
    # run; the root dropped only prefetches of units that had not run, and
    # without a backward nothing freed it. Fixed: units with no backward to
    # come are dropped too.
    pytest.param(FuzzSpec(
        seed=0, world=2, d=1, seq=1, per_rank=1,
        root=NodeSpec(children=(NodeSpec((LeafSpec("linear", bias=False),), (CallSpec(0),)),
                                LeafSpec("linear", bias=False)),
                      calls=(CallSpec(1), CallSpec(0), CallSpec(1))),
        annotations=(Annotation(("c0.c0",)), Annotation(("c1",)), Annotation(("",))),
        prefetch=(True, False, 2, 1), steps=2, eval_between=True),
        id="no-grad-forward-prefetches-a-unit-that-ran"),
    # Deferred init on a 2-D mesh, the root unit holding c0 and c2 around the
    # unit c1: closing the root unit after c0 compared checksums that covered
    # c2's uninitialised memory, which differs between replicas, and raised
    # "ranks initialised different values". Fixed: shards leave the meta
    # device zeroed.
    pytest.param(FuzzSpec(
        seed=0, world=4, d=1, seq=1, per_rank=1,
        root=NodeSpec(children=(LeafSpec("linear", bias=False),
                                NodeSpec((LeafSpec("linear", bias=False),), (CallSpec(0),)),
                                LeafSpec("linear")),
                      calls=(CallSpec(0), CallSpec(1), CallSpec(2))),
        annotations=(Annotation(("c1",)), Annotation(("",))), mesh=(2, 2), meta_init=True),
        id="meta-init-hsdp-unit-entered-twice"),
    # Open bug: c2 called after the root's forward (outside_call) with explicit
    # prefetch targets (c2 forward-prefetches the root): c2's own pass gathers
    # the root again after the root's forward is over, and with no backward to
    # come (all parameters frozen) nothing frees it; the root's drop of unused
    # prefetches runs only at the root's post-forward.
    pytest.param(FuzzSpec(
        seed=0, world=2, d=1, seq=1, per_rank=1,
        root=NodeSpec(children=tuple(LeafSpec("linear", bias=False, frozen=("weight", "bias"))
                                     for _ in range(3)),
                      calls=(CallSpec(0, odd_steps=False, recompute=True),), tie=(0, 1),
                      checkpoint=True),
        annotations=(Annotation(("c2",)), Annotation(("",))), prefetch=(False, False, 2, 1),
        zero_to_none=False, steps=2, eval_between=True, outside_call=2, explicit_prefetch=True,
        meta_init=True),
        id="outside-call-explicit-prefetch-leaves-root-unsharded"),
]


@pytest.mark.parametrize("spec", REGRESSIONS)
def test_regression(spec: FuzzSpec) -> None:
    check_parity(spec)
