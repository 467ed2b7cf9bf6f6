"""Per-rank memory of a ``fully_shard`` annotation, planned in one process
with no process group and no real memory (the model may live on ``meta``).

Usage::

    from fsdp_compose.tools.planner import estimate_memory, propose_units

    with torch.device("meta"):
        model = Transformer(cfg)                 # shapes only
    print(estimate_memory(model, world_size=8))  # every block, then the root
    estimate_memory(model, world_size=8, mp_policy=bf16, batch_fn=lambda m: m.loss(x, y))
    units, estimate = propose_units(model, world_size=8, budget_bytes=20 * 2**30)
    for unit in units:                           # bottom-up, the root last
        fully_shard(unit)

``fully_shard`` needs a process group, so the annotation is given as
``units``: what would be passed to ``fully_shard``, in call order. Each unit
takes the parameters of its subtrees that no earlier unit took and groups
them by (dtype, requires_grad) into flat buffers laid out by
``_layout.FlatLayout``, as ``api.py`` does; the estimate then replays one
training step of the library's schedule ([Note: the simulated step]).
``tests/test_planner.py`` checks it against the profiler on 2 gloo ranks.

[Note: the simulated step]
A step is a list of moments in the library's order (``_schedule.py``,
``_unit.py``, ``_flat_grad.py``); ``total_peak`` is the largest. Forward of
unit i: the root (unsharded until its backward unless
reshard_after_forward=True), unit i and the next ``prefetch`` units (in
flight). Backward of unit i, in reverse order: the root, unit i and the
next ``prefetch`` units in backward order, and then
  (a) unit i's per-parameter gradients (the root's pile up from the start
      of backward: its head runs last in forward) and the padded flat
      gradient the split's backward concatenates them into, both alive for
      a moment (plus a copy when reduce_dtype differs);
  (b) its reduce-scatter, issued while the previous unit's is in flight
      (max_pending_reduces=1): two flat gradients alive. The output is this
      rank's gradient shard, extra only when its dtype or device differs.
Gradient shards exist from their reduce-scatter to the optimizer step
(``zero_grad(set_to_none=True)`` frees them); the step adds the optimizer's
temporaries. A unit's saved activations live from its forward to its
backward; the root's, by where they were saved between the units.
With ``backend="gloo"`` (CPU): each all-gather in flight stages a whole
unsharded buffer; a reduce-scatter is an in-place all-reduce (no copy; with
``set_gloo_reduce_scatter_via_all_reduce(False)`` gloo's reduce-scatter
clones its input until the work is released); the unsharded memory of
resharded units stays in the staging pool (``_staging.py``) until the end of
the iteration, so it counts at its high-water mark. Not estimated: gloo
sometimes keeps the clones of finished reduce-scatters alive into the next
step (none to three whole unit-sized copies per rank at the peak, varying
by rank and run, in ``tests/test_planner.py``'s runs; not a Python cycle).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from .._comm import gloo_reduce_scatter_via_all_reduce
from .._layout import FlatLayout
from ..policies import MixedPrecisionPolicy

Unit = Union[nn.Module, Sequence[nn.Module]]
BatchFn = Callable[[nn.Module], Any]
OPTIMIZER_MOMENTS = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}
"""Per-element state tensors of each optimizer (in the parameters' dtype)."""
BACKENDS = ("nccl", "gloo")
_ROOT = "<root>"


class PeakParts(NamedTuple):
    """What the simulated step holds at its peak moment (bytes; sums to
    ``total_peak``)."""

    sharded_state: int  # parameter shards + optimizer state (0 with offload)
    grads: int  # gradient shards of the units reduced so far
    working_set: int  # unsharded parameters and gradients, copies, optimizer temporaries
    comm_staging: int
    activations: int


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes on one rank (rank 0: it owns the most optimizer state).

    Attributes:
        world_size: the sharding factor.
        backend: ``"nccl"`` (CUDA) or ``"gloo"`` (CPU; see the module notes).
        num_units: ``fully_shard`` calls in the annotation.
        sharded_params: this rank's slice of every flat buffer, padding included.
        grads: the gradient shards of the trainable buffers (all alive at
            the optimizer step).
        optimizer_state: per-element state of the trainable elements this
            rank owns (AdamW 2 tensors, SGD momentum 1), plus Adam's 4-byte
            ``step`` per parameter.
        persistent: ``sharded_params + grads + optimizer_state``.
        transient_unsharded_peak: peak of the working set: unsharded
            parameters (compute dtype), the gradients of the unit in backward
            and of the reduce-scatter in flight, extra reduce-scatter outputs,
            cast shard copies, optimizer temporaries (gloo: the pool's
            high-water mark instead of the unsharded parameters in use).
        comm_staging: peak of the copies the backend makes of what it
            communicates (gloo; 0 for nccl; see the module notes for the
            copies gloo may keep longer, not counted).
        activations: bytes autograd saves in one ``batch_fn`` forward
            (measured on fake tensors); ``None`` without ``batch_fn``.
        state_peak: the largest moment of sharded state, gradients and
            working set alone (no staging, no activations).
        total_peak: the largest moment of the step on the compute device
            (parts in ``peak_parts``; less than the sum of the fields, which
            peak at different moments). Without ``batch_fn`` activations
            count 0. With offload it excludes ``cpu_bytes``. Not modelled:
            activation gradients, kernel workspaces, fragmentation.
        peak_at: that moment, e.g. "backward of 'blocks.3': reduce-scatter".
        peak_parts: what the peak moment holds.
        cpu_bytes: persistent bytes in host memory through offload (0
            without it, and with gloo, where offload changes nothing).
        largest_unit: the unit with the most unsharded bytes, and
        largest_unit_bytes: those bytes (compute dtype).
    """

    world_size: int
    backend: str
    num_units: int
    sharded_params: int
    grads: int
    optimizer_state: int
    persistent: int
    transient_unsharded_peak: int
    comm_staging: int
    activations: Optional[int]
    state_peak: int
    total_peak: int
    peak_at: str
    peak_parts: PeakParts
    cpu_bytes: int
    largest_unit: str
    largest_unit_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "peak_parts": self.peak_parts._asdict()}

    def __str__(self) -> str:
        acts = "-- (pass batch_fn)" if self.activations is None else _fmt(self.activations)
        rows = [("sharded parameters", _fmt(self.sharded_params)),
                ("gradients", _fmt(self.grads)),
                ("optimizer state", _fmt(self.optimizer_state)),
                ("persistent", _fmt(self.persistent) + (" (CPU)" if self.cpu_bytes else "")),
                ("unsharded working set", _fmt(self.transient_unsharded_peak)),
                ("comm staging", _fmt(self.comm_staging)),
                ("activations", acts),
                ("peak without those two", _fmt(self.state_peak)),
                ("total peak", f"{_fmt(self.total_peak)} at {self.peak_at}"),
                ("largest unit", f"{self.largest_unit} ({_fmt(self.largest_unit_bytes)})")]
        width = max(len(name) for name, _ in rows)
        return "\n".join([f"per-rank memory of {self.num_units} units on {self.world_size} "
                          f"ranks ({self.backend})"]
                         + [f"  {name:<{width}}  {value}" for name, value in rows])


class Proposal(NamedTuple):
    """The units to pass to ``fully_shard`` in order (the root last), and
    their estimate."""

    units: list[Unit]
    estimate: MemoryEstimate


# ----------------------------------------------------------------- public
def default_units(model: nn.Module) -> list[Unit]:
    """Every child of every ``nn.ModuleList`` in ``model`` (the blocks, in
    module order), then ``model``: "every block, then the root"."""
    return [child for m in model.modules() if isinstance(m, nn.ModuleList)
            for child in m.children()] + [model]


def estimate_memory(model: nn.Module, world_size: int, *, units: Optional[Sequence[Unit]] = None,
                    optimizer: str = "adamw", mp_policy: Optional[MixedPrecisionPolicy] = None,
                    offload: bool = False, prefetch: int = 1, batch_fn: Optional[BatchFn] = None,
                    reshard_after_forward: Optional[bool] = None,
                    backend: str = "nccl") -> MemoryEstimate:
    """Estimate one rank's memory for training ``model`` annotated by ``units``.

    Args:
        model: the whole model on any device (``meta`` is enough: only
            shapes, dtypes and ``requires_grad`` are read).
        world_size: ranks the units shard over.
        units: the ``fully_shard`` calls in order, ending with ``model`` (a
            list entry is one unit of sibling modules). Default: :func:`default_units`.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` (with momentum) or ``"none"``.
        mp_policy: every unit's mixed precision.
        offload: ``CPUOffloadPolicy()`` on every unit.
        prefetch: units all-gathered ahead of the running one (the library's
            default schedule prefetches one).
        batch_fn: runs one forward of one rank's batch, e.g.
            ``lambda m: m.loss(x, y)``, on fake tensors (``FakeTensorMode``:
            tensors take no memory; ``.item()`` reads 1), to measure the
            saved activations and the units' forward order.
        reshard_after_forward: ``fully_shard``'s, for every unit.
        backend: ``"nccl"`` (CUDA) or ``"gloo"`` (CPU).

    Raises:
        ValueError: an unknown option, units that do not end with ``model``,
            or a parameter shared by two units (naming it).
    """
    for name, value, allowed in (("optimizer", optimizer, OPTIMIZER_MOMENTS),
                                 ("backend", backend, BACKENDS)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {sorted(allowed)}, got {value!r}")
    if world_size < 1 or prefetch < 0:
        raise ValueError(f"need world_size >= 1 and prefetch >= 0, got {world_size}, {prefetch}")
    offload = offload and backend == "nccl"  # on a CPU mesh offload changes nothing
    specs = _resolve_units(model, default_units(model) if units is None else units)
    plans = [_plan_unit(s, world_size, mp_policy or MixedPrecisionPolicy(), offload)
             for s in specs]
    order, unit_acts, root_acts = list(range(len(specs) - 1)), [0] * len(specs), [0]
    if batch_fn is not None:
        ran, unit_acts, root_acts = _fake_forward(model, [s.modules for s in specs[:-1]],
                                                  batch_fn)
        order = ran + [i for i in order if i not in ran]  # units the batch did not run last
    step = _Step([plans[-1]] + [plans[i] for i in order], [0] + [unit_acts[i] for i in order],
                 root_acts, OPTIMIZER_MOMENTS[optimizer], optimizer.startswith("adam"),
                 offload, backend == "gloo", backend == "gloo" and world_size > 1, prefetch,
                 reshard_after_forward)
    return step.estimate(world_size, backend,
                         None if batch_fn is None else sum(unit_acts) + sum(root_acts))


def propose_units(model: nn.Module, world_size: int, budget_bytes: int,
                  **estimate_kwargs: Any) -> Proposal:
    """The coarsest annotation whose ``total_peak`` fits ``budget_bytes``:
    the root alone, every block and the root, then finer and finer: each
    step splits the units the step before added into their children with
    parameters (the first also adds the root's modules outside the blocks,
    e.g. embeddings and head). A module that shares a parameter with one
    outside it is never a unit of its own.

    Raises:
        ValueError: nothing fits; the message shows the best estimate.
    """
    best: Optional[Proposal] = None
    for units in _granularities(model):
        estimate = estimate_memory(model, world_size, units=units, **estimate_kwargs)
        if estimate.total_peak <= budget_bytes:
            return Proposal(units, estimate)
        if best is None or estimate.total_peak < best.estimate.total_peak:
            best = Proposal(units, estimate)
    raise ValueError(
        f"no annotation fits {_fmt(budget_bytes)} per rank on {world_size} ranks; the best "
        f"({best.estimate.num_units} units) needs {_fmt(best.estimate.total_peak)}:\n"
        f"{best.estimate}\nTry more ranks, mixed precision, offload or a larger budget.")


# ------------------------------------------------------------ annotation
class _Spec(NamedTuple):
    name: str
    modules: tuple[nn.Module, ...]
    params: tuple[nn.Parameter, ...]


def _resolve_units(model: nn.Module, units: Sequence[Unit]) -> list[_Spec]:
    """The parameters each unit takes: its modules' subtrees minus those of
    earlier units (``api._managed_modules``), each parameter once
    (``api._collect_records``)."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    groups = [[u] if isinstance(u, nn.Module) else list(u) for u in units]
    if not groups or groups[-1] != [model]:
        raise ValueError("units must end with the model itself, the root unit: append model")
    annotated: set[int] = set()
    owner: dict[int, str] = {}
    specs = []
    for modules in groups:
        for m in modules:
            if id(m) not in names or id(m) in annotated:
                raise ValueError(f"{type(m).__name__} in units is not a submodule of the model "
                                 "or appears twice")
        label = ", ".join(names[id(m)] or _ROOT for m in modules)
        label = f"[{label}]" if len(modules) > 1 else label
        params: dict[int, nn.Parameter] = {}
        stack, seen = list(reversed(modules)), set()
        while stack:
            m = stack.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            for attr, p in m._parameters.items():
                if p is None or id(p) in params:
                    continue
                if id(p) in owner:
                    fqn = f"{names[id(m)]}.{attr}".lstrip(".")
                    raise ValueError(
                        f"parameter '{fqn}' of unit {label} is already in unit {owner[id(p)]} "
                        "(shared, e.g. tied embeddings): only their common ancestor can hold it")
                params[id(p)] = p
            stack.extend(c for c in reversed(list(m.children())) if id(c) not in annotated)
        owner.update(dict.fromkeys(params, label))
        annotated.update(id(m) for m in modules)
        specs.append(_Spec(label, tuple(modules), tuple(params.values())))
    return specs


def _granularities(model: nn.Module) -> Iterator[list[Unit]]:
    """Annotations for :func:`propose_units`, coarse to fine, root last."""
    yield [model]
    units = default_units(model)[:-1]
    if units:
        yield [*units, model]
    units = _outside(model, units) + units
    frontier, count = units, len(units)
    while frontier:
        refined, new = [], []
        for m in units:
            kids = _parts(model, m) if any(m is f for f in frontier) else []
            refined += kids
            new += kids
            if not kids or _keeps_params(m, kids):
                refined.append(m)  # after its children: it takes what they left
        units, frontier = refined, new
        if new or len(units) != count:
            count = len(units)
            yield [*units, model]


def _unit_children(module: nn.Module) -> list[nn.Module]:
    """Children that can be units: containers opened, parameterless skipped."""
    out = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out += _unit_children(child)
        elif next(child.parameters(), None) is not None:
            out.append(child)
    return out


def _parts(model: nn.Module, module: nn.Module) -> list[nn.Module]:
    return [c for c in _unit_children(module) if _self_contained(model, c)]


def _outside(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The highest modules below ``model`` with parameters that neither are
    nor hold a block."""
    out = []
    for child in _unit_children(model):
        if any(child is b for b in blocks):
            continue
        if any(b is m for b in blocks for m in child.modules()):
            out += _outside(child, blocks)
        elif _self_contained(model, child):
            out.append(child)
    return out


def _self_contained(model: nn.Module, module: nn.Module) -> bool:
    """No parameter of ``module`` is also registered outside it."""
    inside = {id(m) for m in module.modules()}
    mine = {id(p) for p in module.parameters()}
    return not any(id(p) in mine for m in model.modules() if id(m) not in inside
                   for p in m._parameters.values() if p is not None)


def _keeps_params(module: nn.Module, kids: list[nn.Module]) -> bool:
    taken = {id(p) for k in kids for p in k.parameters()}
    return any(id(p) not in taken for p in module.parameters())


# ---------------------------------------------------------------- layout
class _UnitPlan(NamedTuple):
    """Bytes of one unit on rank 0 (see [Note: the simulated step])."""

    name: str
    sharded: int
    grads: int  # gradient shards (trainable buffers)
    state: int  # one optimizer state tensor per owned trainable element
    trainable_params: int
    unsharded: tuple[int, ...]  # per buffer, compute dtype
    view_grads: int  # per-parameter gradients before the split's backward
    flat_grad: int  # the split's output, compute dtype
    flat_reduce: int  # the reduce-scatter input, reduce dtype
    reduce_extra: int  # reduce-scatter outputs that are not the gradient shard
    shard_copy: int  # the cast/moved shard an all-gather reads
    largest_slice: int  # bytes of the largest parameter slice a rank owns


class _Buffer(NamedTuple):
    layout: FlatLayout
    size: int  # element sizes: parameters, compute (all-gather), reduce-scatter
    compute: int
    reduce: int
    params: list[nn.Parameter]
    extra_output: bool  # the reduce-scatter output is not the gradient shard
    shard_copy: bool  # the all-gather reads a cast/moved copy of the shard
    aliased: bool  # one rank: the unsharded buffer is the shard itself


def _plan_unit(spec: _Spec, world: int, mp: MixedPrecisionPolicy, offload: bool) -> _UnitPlan:
    groups: dict[tuple[torch.dtype, bool], list[nn.Parameter]] = {}
    for p in spec.params:  # as api._group_records
        groups.setdefault((p.dtype, p.requires_grad), []).append(p)
    buffers, train = [], []
    for (dtype, trainable), params in groups.items():
        floating = dtype.is_floating_point
        compute = (mp.param_dtype if floating else None) or dtype
        reduce = (mp.reduce_dtype if floating else None) or compute
        if world > 1 and floating and mp.reduce_comm_dtype is not None:
            reduce = mp.reduce_comm_dtype  # what the collective reads (see _flat_grad.py)
        b = _Buffer(FlatLayout([p.shape for p in params], world), dtype.itemsize,
                    compute.itemsize, reduce.itemsize, params, offload or reduce != dtype,
                    offload or compute != dtype and world > 1,
                    world == 1 and compute == dtype and not offload)
        buffers.append(b)
        if trainable:
            train.append(b)
    return _UnitPlan(
        name=spec.name,
        sharded=sum(b.layout.shard_numel * b.size for b in buffers),
        grads=sum(b.layout.shard_numel * b.size for b in train),
        # rank 0 owns no padding: min(shard, numel) elements
        state=sum(min(b.layout.shard_numel, b.layout.numel) * b.size for b in train),
        trainable_params=sum(len(b.params) for b in train),
        unsharded=tuple(0 if b.aliased else b.layout.padded_numel * b.compute for b in buffers),
        view_grads=sum(b.layout.numel * b.compute for b in train),
        flat_grad=sum(b.layout.padded_numel * b.compute for b in train),
        # one rank: the flat gradient itself becomes the gradient shard
        flat_reduce=0 if world == 1 else sum(b.layout.padded_numel * b.reduce for b in train),
        reduce_extra=sum(b.layout.shard_numel * b.reduce for b in train if b.extra_output),
        shard_copy=sum(b.layout.shard_numel * b.compute for b in buffers if b.shard_copy),
        largest_slice=max((min(p.numel(), b.layout.shard_numel) * b.size
                           for b in train for p in b.params), default=0))


# ----------------------------------------------------------- activations
class _ScalarReads(TorchDispatchMode):
    """``.item()``/``bool(t)`` of a fake tensor reads 1 (True): models
    branch on values (Hugging Face: "is the attention mask all ones?")."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1
        return func(*args, **(kwargs or {}))


def _fake_forward(model: nn.Module, unit_modules: list[tuple[nn.Module, ...]],
                  batch_fn: BatchFn) -> tuple[list[int], list[int], list[int]]:
    """Run ``batch_fn(model)`` with every parameter and buffer swapped for a
    fake CPU tensor (so inputs may be small CPU tensors; CUDA's attention
    kernels may save somewhat different tensors). Returns the units (by index) in the order
    their forward first ran, the bytes of the distinct storages autograd
    saved while each unit was the innermost one running, and the root's
    saved bytes by position (``[p]``: after ``p`` units had started)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    owner = {id(m): i for i, modules in enumerate(unit_modules) for m in modules}
    running: list[int] = []
    order: list[int] = []
    unit_acts = [0] * (len(unit_modules) + 1)
    root_acts = [0] * (len(unit_modules) + 1)
    saved: dict[int, torch.Tensor] = {}  # storage -> a tensor on it (keeps the key unique)

    def pre(module, args):
        running.append(owner[id(module)])
        if running[-1] not in order:
            order.append(running[-1])

    def post(module, args, output):
        running.pop()  # returns None: the output stays as it is

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in saved and key not in weights:
            saved[key] = t
            nbytes = t.untyped_storage().nbytes()
            if running:
                unit_acts[running[-1]] += nbytes
            else:
                root_acts[len(order)] += nbytes
        return t

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}
    slots = [(table, name, t) for m in model.modules() for table in (m._parameters, m._buffers)
             for name, t in table.items() if t is not None]
    with mode:
        for _, _, t in slots:
            if id(t) not in fakes:
                fakes[id(t)] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                   device="cpu").requires_grad_(t.requires_grad)
    weights = {fakes[id(p)].untyped_storage()._cdata for p in model.parameters()}
    handles = [h for modules in unit_modules for m in modules
               for h in (m.register_forward_pre_hook(pre),
                         m.register_forward_hook(post, always_call=True))]
    try:
        for table, name, t in slots:
            table[name] = fakes[id(t)]
        with mode, _ScalarReads(), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            batch_fn(model)
    finally:
        for table, name, t in slots:
            table[name] = t
        for h in handles:
            h.remove()
    return order, unit_acts, root_acts


# ------------------------------------------------------------ simulation
class _Moment(NamedTuple):
    label: str
    live: frozenset  # plan indices whose parameters are unsharded
    transient: int  # other working-set bytes
    comm: int
    reduced: frozenset  # plan indices whose gradient shard exists
    acts: int


@dataclass
class _Step:
    """One training step (see [Note: the simulated step]); plans in forward
    order, the root first."""

    plans: list[_UnitPlan]
    unit_acts: list[int]
    root_acts: list[int]  # by position: after that many units started
    moments: int
    adam: bool
    offload: bool
    pool: bool  # the CPU staging pool keeps unsharded memory
    staging: bool  # gloo copies what it communicates
    prefetch: int
    reshard_after_forward: Optional[bool]

    def estimate(self, world: int, backend: str, activations: Optional[int]) -> MemoryEstimate:
        plans = self.plans
        sharded = sum(p.sharded for p in plans)
        grads = sum(p.grads for p in plans)
        state = self.moments * sum(p.state for p in plans)
        state += 4 * sum(p.trainable_params for p in plans) if self.adam else 0
        fixed = 0 if self.offload else sharded + state
        moments = list(self._moments())
        pool = self._pool(moments) if self.pool else None
        parts = []
        for m in moments:
            unsharded = pool if pool is not None else sum(sum(plans[i].unsharded) for i in m.live)
            shard_grads = 0 if self.offload else sum(plans[i].grads for i in m.reduced)
            parts.append(PeakParts(fixed, shard_grads, unsharded + m.transient, m.comm, m.acts))
        peak = max(range(len(parts)), key=lambda i: sum(parts[i]))
        largest = max(plans, key=lambda p: sum(p.unsharded))
        return MemoryEstimate(
            world_size=world, backend=backend, num_units=len(plans), sharded_params=sharded,
            grads=grads, optimizer_state=state, persistent=sharded + grads + state,
            transient_unsharded_peak=max(p.working_set for p in parts),
            comm_staging=max(p.comm_staging for p in parts), activations=activations,
            state_peak=max(sum(p[:3]) for p in parts),
            total_peak=sum(parts[peak]), peak_at=moments[peak].label, peak_parts=parts[peak],
            cpu_bytes=sharded + grads + state if self.offload else 0,
            largest_unit=largest.name, largest_unit_bytes=sum(largest.unsharded))

    def _moments(self) -> Iterator[_Moment]:
        plans, k, n = self.plans, self.prefetch, len(self.plans)
        gloo = self.staging
        # gloo's reduce-scatter clones its input; the in-place all-reduce that
        # replaces it by default does not (see [Note: gloo reduce-scatter as an
        # all-reduce] in _comm.py)
        gloo_reduce_copy = gloo and not gloo_reduce_scatter_via_all_reduce()
        keep_root = {0} if self.reshard_after_forward is not True else set()

        def staged(units) -> int:  # gloo's copy of each all-gather in flight
            return sum(sum(plans[j].unsharded) for j in units) if gloo else 0

        def acts(i: int, own: bool) -> int:  # root's saved before unit i, units 1..i
            return sum(self.root_acts[:i]) + sum(self.unit_acts[1:i + own])

        none = frozenset()
        for i in range(n):  # forward
            ahead = set(range(i + 1, min(i + k, n - 1) + 1))
            kept = set(range(i)) if self.reshard_after_forward is False else set()
            yield _Moment(_label("forward", plans[i], "all-gather"),
                          frozenset({i} | ahead | keep_root | kept),
                          sum(plans[j].shard_copy for j in ahead | {i}),
                          staged(ahead | {i}), none, acts(i, True))
        yield _Moment("end of forward", frozenset(keep_root | (set(range(n))
                      if self.reshard_after_forward is False else set())), 0, 0, none,
                      sum(self.root_acts) + sum(self.unit_acts))
        reduced: set[int] = set()
        pending: Optional[int] = None  # the unit whose reduce-scatter is in flight
        for i in range(n - 1, -1, -1):  # backward
            p = plans[i]
            ahead = set(range(max(i - k, 1), i))
            live = frozenset({0, i} | ahead | (set(range(i)) if self.reshard_after_forward
                                               is False else set()))
            flying = 0 if pending is None else plans[pending].flat_reduce + \
                plans[pending].reduce_extra
            held = flying + (plans[0].view_grads if i else 0)  # root's parameter gradients
            comm = flying if gloo_reduce_copy else 0
            yield _Moment(_label("backward", p, "start"), live,
                          held + sum(plans[j].shard_copy for j in ahead),
                          comm + staged(ahead), frozenset(reduced), acts(i, True))
            if not p.flat_grad:
                continue  # frozen only: no gradient, no reduce-scatter
            cast = p.flat_reduce if p.flat_reduce != p.flat_grad else 0
            yield _Moment(_label("backward", p, "gradients"), live,
                          held + p.view_grads + p.flat_grad + cast, comm,
                          frozenset(reduced), acts(i, False))
            if not p.reduce_extra:
                reduced.add(i)  # the reduce-scatter's output is the gradient shard
            yield _Moment(_label("backward", p, "reduce-scatter"), live,
                          held + p.flat_reduce + p.reduce_extra,
                          comm + (p.flat_reduce if gloo_reduce_copy else 0), frozenset(reduced),
                          acts(i, False))
            if pending is not None:
                reduced.add(pending)
            pending = i
        temp = 0
        if self.adam and not self.offload:  # sqrt and division temporaries of the update
            temp = 2 * max(p.largest_slice for p in plans) if self.pool else \
                sum(p.grads for p in plans)  # CPU: per parameter; CUDA: foreach, whole shards
        yield _Moment("optimizer step", none, temp, 0, frozenset(range(n)), 0)

    def _pool(self, moments: list[_Moment]) -> int:
        """The CPU staging pool's high-water mark: per buffer size, the most
        buffers of that size unsharded at once."""
        most: dict[int, int] = {}
        for m in moments:
            count: dict[int, int] = {}
            for i in m.live:
                for size in self.plans[i].unsharded:
                    count[size] = count.get(size, 0) + 1
            for size, c in count.items():
                most[size] = max(most.get(size, 0), c)
        return sum(size * c for size, c in most.items())


def _label(phase: str, plan: _UnitPlan, what: str) -> str:
    return f"{phase} of {plan.name if plan.name == _ROOT else repr(plan.name)}: {what}"


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
