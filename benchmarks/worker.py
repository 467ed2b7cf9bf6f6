"""What each rank does in one scenario: reference losses, the memory pass, the
interleaved timing rounds. Not run directly; ``benchmarks/run.py`` starts it
on every rank, e.g.

    .venv/bin/python -m benchmarks.run --scenario default --quick

Order of one scenario (all ranks in lockstep):

1. rank 0 trains a single-process reference on the *global* batch for
   ``ref_steps`` steps and measures the activation bytes of one per-rank batch;
2. memory pass: each implementation in turn is built, trained for
   ``mem_steps`` steps under the allocation profiler, and dropped; then
   again each in turn without the profiler, for the resident set's
   high-water mark and the page faults per step; and again under torch's
   ``MemTracker`` (its peak and after-step figures, and a direct count);
3. timing pass: all implementations are built side by side, warmed up, then
   run round-robin (``rounds`` rounds of ``steps`` steps each; the order
   rotates every round) so that machine noise hits all of them alike.

Every implementation starts from the same seeded model and sees the same
batches in the same order (step ``i`` of every implementation trains on
global batch ``i``), so their losses are comparable step by step.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fsdp_compose.testing import GPT, GPTConfig, synthetic_tokens

from .impls import BUILDERS, VARIANTS, units_of
from .memory import (activation_bytes, analytic_bounds, measure_mem_tracker,
                     measure_process_memory, measure_training_memory)


@dataclass
class Settings:
    """One scenario, as every rank runs it."""

    scenario: str
    cfg: GPTConfig
    impls: list[str]
    batch_per_rank: int
    lr: float
    seed: int
    warmup: int
    rounds: int
    steps: int
    ref_steps: int
    mem_steps: int

    @property
    def total_steps(self) -> int:
        return self.warmup + self.rounds * self.steps


def loss_of(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy. Calls ``module(x)`` (not ``GPT.loss``)
    so that wrappers (DDP, FSDP1) run their own forward."""
    logits = module(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def new_model(s: Settings) -> GPT:
    torch.manual_seed(s.seed)
    return GPT(s.cfg)


def build(s: Settings, name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    module = (BUILDERS | VARIANTS)[name](new_model(s))
    return module, torch.optim.AdamW(module.parameters(), lr=s.lr)


def global_batch(s: Settings, step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic_tokens(step, s.batch_per_rank * world, s.cfg.seq_len, s.cfg.vocab_size,
                            seed=s.seed)


def rank_batch(s: Settings, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(s, step, world)
    rows = slice(rank * s.batch_per_rank, (rank + 1) * s.batch_per_rank)
    return x[rows].contiguous(), y[rows].contiguous()


def train_step(module: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> tuple[float, tuple[float, float, float]]:
    """One step; returns this rank's loss and (forward, backward, optimizer) seconds."""
    t0 = time.perf_counter()
    loss = loss_of(module, x, y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    optim.step()
    optim.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    return loss.item(), (t1 - t0, t2 - t1, t3 - t2)


# --------------------------------------------------------------- 1. reference
def reference(s: Settings, world: int) -> dict[str, Any]:
    """Rank 0 only: losses of one process training on the global batch, and
    the activation bytes of one per-rank batch (plain model)."""
    model = new_model(s)
    x0, y0 = rank_batch(s, 0, 0, world)
    acts = activation_bytes(model, lambda m: loss_of(m, x0, y0))
    logits_bytes = x0.numel() * s.cfg.vocab_size * 4
    bounds = analytic_bounds(units_of(model), world, acts, logits_bytes)
    optim = torch.optim.AdamW(model.parameters(), lr=s.lr)
    losses = []
    for step in range(s.ref_steps):
        x, y = global_batch(s, step, world)
        loss, _ = train_step(model, optim, x, y)
        losses.append(loss)
    return {"losses": losses, "bounds": bounds}


# -------------------------------------------------------------- 2. memory pass
def memory_pass(s: Settings, rank: int, world: int) -> dict[str, dict]:
    batches = [rank_batch(s, i, rank, world) for i in range(s.mem_steps)]

    def measure(measure_fn, name: str):
        dist.barrier()
        result = measure_fn(
            build=lambda: build(s, name),
            step=lambda module, optim, i: train_step(module, optim, *batches[i]),
            steps=s.mem_steps,
            settle=lambda: (dist.barrier(), gc.collect(), time.sleep(0.1)))
        gc.collect()
        return result

    out = {}
    for name in s.impls:
        report = measure(measure_training_memory, name)
        out[name] = asdict(report) | {"train_peak": report.train_peak}
    for name in s.impls:  # no profiler attached: RSS high-water mark and page faults
        out[name] |= asdict(measure(measure_process_memory, name))
    for name in s.impls:  # torch's MemTracker, next to a direct count of the state
        out[name] |= asdict(measure(measure_mem_tracker, name))
    return out


# -------------------------------------------------------------- 3. timing pass
def timing_pass(s: Settings, rank: int, world: int, log) -> dict[str, Any]:
    batches = [rank_batch(s, i, rank, world) for i in range(s.total_steps)]
    built = {name: build(s, name) for name in s.impls}
    losses = {name: [] for name in s.impls}
    phases = {name: [] for name in s.impls}     # per timed step: (fwd, bwd, opt) seconds
    rounds = {name: [] for name in s.impls}     # round index of each timed step

    def run(name: str, round_index: int) -> None:
        module, optim = built[name]
        dist.barrier()  # start aligned; the wait for the slower rank is not timed
        loss, times = train_step(module, optim, *batches[len(losses[name])])
        losses[name].append(loss)
        if round_index >= 0:
            phases[name].append(times)
            rounds[name].append(round_index)

    for name in s.impls:
        for _ in range(s.warmup):
            run(name, -1)
    gc.collect()
    n = len(s.impls)
    for r in range(s.rounds):
        order = s.impls[r % n:] + s.impls[:r % n]
        for name in order:
            for _ in range(s.steps):
                run(name, r)
        log(f"round {r + 1}/{s.rounds} done")
    del built
    gc.collect()
    return {"losses": losses, "phases": phases, "rounds": rounds}


def gather(obj: Any, world: int) -> list[Any]:
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def run_scenario(s: Settings, rank: int, world: int, log) -> dict[str, Any] | None:
    """Everything for one scenario; returns the raw results on rank 0."""
    start = time.perf_counter()

    def say(msg: str) -> None:
        if rank == 0:
            log(f"[{s.scenario} {time.perf_counter() - start:6.1f}s] {msg}")

    ref = None
    say(f"reference: {s.ref_steps} single-process steps on the global batch (rank 0)")
    if rank == 0:
        ref = reference(s, world)
    dist.barrier()
    say(f"memory pass: {s.mem_steps} steps per implementation under the allocation profiler")
    mem = gather(memory_pass(s, rank, world), world)
    say(f"timing: {s.warmup} warm-up steps each, then {s.rounds} rounds x {s.steps} steps, "
        f"round-robin over {', '.join(s.impls)}")
    timing = gather(timing_pass(s, rank, world, say), world)
    say("done")
    if rank != 0:
        return None
    return {"reference": ref, "memory": mem, "timing": timing}
