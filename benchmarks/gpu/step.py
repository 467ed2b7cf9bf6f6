"""The GPU benchmark: fsdp_compose, torch FSDP2 and the unsharded model on
one GPU, in one command (~3 min on an H100).

    python -m benchmarks.gpu                       # everything below
    python -m benchmarks.gpu --only world1 --configs many-small
    python -m benchmarks.gpu --device cpu --quick  # the script's logic, on the CPU

``world1``: world size 1 over NCCL (gloo on the CPU). For each GPT config,
each variant is first measured alone (built, then ``--memory-steps`` steps,
then freed with ``gc.collect()`` and ``torch.cuda.empty_cache()`` so one
variant's leftovers never count against the next): the peak of each phase
(forward, backward, optimizer) of every step, from
``torch.cuda.max_memory_allocated`` reset before each phase, and the losses.
Then all variants are built again and timed in interleaved rounds (one
round: ``--steps`` steps of each variant, in rotated order; CUDA events
around each step); the step time is the best round's median. Every variant
computes in bf16 and keeps fp32 master weights: fsdp_compose and FSDP2 with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on every block
and the root, the unsharded model under ``torch.autocast``; AdamW. On the
many-small config the design's floor (``benchmarks/host_cost/floor.py``, under
autocast too) is timed beside them: how close to the unsharded model a
unit of this design can get on the host.

``world2``: two ranks sharing the GPU over gloo (``cpu:gloo,cuda:gloo``),
fp32: fsdp_compose's and FSDP2's losses against one process on the global
batch, step time (gloo moves CUDA tensors through the host: this measures
correctness and memory, not interconnect speed) and each rank's peak.

Estimated TFLOP/s: 6 x parameters x tokens + 12 x layers x width x sequence
x tokens (causal attention counted whole), over the step time.
Results: a table on stdout; ``--json PATH`` writes every number.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from fsdp_compose.testing import GPT, GPTConfig, synthetic_tokens, train_losses

GiB = 2 ** 30
CONFIGS = {  # name: (config, batch)
    "gpt-782m": (GPTConfig(vocab_size=32768, seq_len=1024, d_model=1536, n_heads=12,
                           n_layers=24), 8),
    "many-small": (GPTConfig(vocab_size=8192, seq_len=512, d_model=512, n_heads=8,
                             n_layers=48), 16),
    "gpt-124m": (GPTConfig(vocab_size=32768, seq_len=1024, d_model=768, n_heads=12,
                           n_layers=12), 8),
}
QUICK = {"gpt-tiny": (GPTConfig(vocab_size=512, seq_len=64, d_model=64, n_heads=4,
                                n_layers=4), 4)}
WORLD2_CONFIG = (GPTConfig(vocab_size=4096, seq_len=256, d_model=256, n_heads=8, n_layers=6), 4)
VARIANTS = ("unsharded", "fsdp_compose", "fsdp2")
FLOOR_CONFIGS = ("many-small", "gpt-tiny")
"""Configs whose world-1 runs also time the design's floor (``host_cost/floor.py``:
the torch work of fsdp_compose's design per unit with next to no Python,
under autocast as the unsharded model): what the host costs at the least
where units are many and small."""


@dataclass
class StepMemory:
    """Peak GiB of each phase of one step (each phase's peak counted from
    its start, so the forward's includes everything held before it):
    ``torch.cuda.max_memory_allocated`` (the allocator's blocks: a request
    served from a larger cached block counts the whole block when the rest
    is too small to split off) and the peak of the bytes requested
    (``requested_bytes.all.peak``: what the program asked for)."""

    forward: float
    backward: float
    optimizer: float
    requested_forward: float = float("nan")
    requested_backward: float = float("nan")
    requested_optimizer: float = float("nan")


@dataclass
class VariantResult:
    config: str
    variant: str
    step_ms: Optional[float] = None
    tokens_per_s: Optional[float] = None
    tflops: Optional[float] = None
    memory: list[StepMemory] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    error: Optional[str] = None


# --------------------------------------------------------------------------- building

def _build(variant: str, cfg: GPTConfig, device: torch.device, bf16: bool
           ) -> tuple[nn.Module, torch.optim.Optimizer, Callable]:
    """The seeded model as ``variant`` (same initial values for every
    variant), its AdamW, and the forward-with-loss to call."""
    torch.manual_seed(0)
    with device:
        model = GPT(cfg)
    low = torch.bfloat16 if bf16 else None
    if variant == "fsdp_compose":
        from fsdp_compose import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if bf16 else None
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    elif variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)} \
            if bf16 else {}
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
    elif variant == "floor":
        from benchmarks.host_cost.floor import floor_units
        floor_units(model, model.blocks)  # the hooks on the modules keep the units
    elif variant != "unsharded":
        raise ValueError(variant)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if variant in ("unsharded", "floor") and bf16:
        def loss_fn(x, y):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return model.loss(x, y)
    else:
        loss_fn = model.loss
    return model, optim, loss_fn


def _batches(cfg: GPTConfig, batch: int, device: torch.device, count: int, world: int = 1
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` global batches of ``batch * world`` rows, on ``device``."""
    return [tuple(t.to(device) for t in synthetic_tokens(step, batch * world, cfg.seq_len,
                                                         cfg.vocab_size, seed=3))
            for step in range(count)]


def _flops_per_step(cfg: GPTConfig, batch: int, params: int) -> float:
    tokens = batch * cfg.seq_len
    return 6 * params * tokens + 12 * cfg.n_layers * cfg.d_model * cfg.seq_len * tokens


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- measuring

class _Peaks:
    """Peak allocated bytes since the last ``mark`` (CUDA only; None on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def read(self) -> tuple[float, float]:
        """(allocated peak, requested peak) in GiB."""
        if not self.cuda:
            return float("nan"), float("nan")
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        return (stats["allocated_bytes.all.peak"] / GiB,
                stats.get("requested_bytes.all.peak", float("nan")) / GiB)


def _memory_pass(variant: str, cfg: GPTConfig, batch: int, device: torch.device, bf16: bool,
                 steps: int) -> tuple[list[StepMemory], list[float]]:
    """Build ``variant`` alone, run ``steps`` steps reading each phase's
    peak, free it. Returns (peaks per step, global mean losses)."""
    _free()
    model, optim, loss_fn = _build(variant, cfg, device, bf16)
    rank, world = dist.get_rank(), dist.get_world_size()
    peaks, memory, losses = _Peaks(device), [], []
    try:
        for x, y in _batches(cfg, batch, device, steps, world):
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            peaks.mark()
            loss = loss_fn(x, y)
            forward = peaks.read()
            peaks.mark()
            loss.backward()
            backward = peaks.read()
            peaks.mark()
            optim.step()
            optim.zero_grad(set_to_none=True)
            optimizer = peaks.read()
            memory.append(StepMemory(forward[0], backward[0], optimizer[0],
                                     forward[1], backward[1], optimizer[1]))
            mean = loss.detach().float().reshape(1)
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
    finally:
        del model, optim, loss_fn
        _free()
    return memory, losses


def _step(loss_fn: Callable, optim: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
          ) -> None:
    loss_fn(x, y).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _timed_steps(built: tuple, batches: list, device: torch.device) -> list[float]:
    """Milliseconds of each step: CUDA events on the GPU, the host clock on
    the CPU."""
    _, optim, loss_fn = built
    times = []
    for x, y in batches:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _step(loss_fn, optim, x, y)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            _step(loss_fn, optim, x, y)
            times.append((time.perf_counter() - begin) * 1e3)
    return times


def _timing_pass(names: list[str], cfg: GPTConfig, batch: int, device: torch.device, bf16: bool,
                 rounds: int, steps: int, warmup: int) -> dict[str, float]:
    """Best-of-``rounds`` median step ms of each variant, interleaved."""
    rank, world = dist.get_rank(), dist.get_world_size()
    built = {name: _build(name, cfg, device, bf16) for name in names}
    batches = [(x.chunk(world)[rank], y.chunk(world)[rank])
               for x, y in _batches(cfg, batch, device, steps, world)]
    for name in names:
        _timed_steps(built[name], batches[:warmup], device)
    best: dict[str, float] = {}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            median = statistics.median(_timed_steps(built[name], batches, device))
            best[name] = min(best.get(name, float("inf")), median)
    del built
    _free()
    return best


def measure_config(config: str, cfg: GPTConfig, batch: int, device: torch.device,
                   variants: list[str], options: argparse.Namespace, bf16: bool = True
                   ) -> list[VariantResult]:
    """Memory and losses of each variant alone, then interleaved timing."""
    results = {v: VariantResult(config, v) for v in variants}
    for variant in variants:
        try:
            results[variant].memory, results[variant].losses = _memory_pass(
                variant, cfg, batch, device, bf16, options.memory_steps)
        except Exception as e:  # noqa: BLE001 - reported in the table, the others go on
            results[variant].error = f"{type(e).__name__}: {str(e)[:300]}"
    timed = [v for v in variants if results[v].error is None]
    try:
        best = _timing_pass(timed, cfg, batch, device, bf16, options.rounds, options.steps,
                            options.warmup)
    except Exception as e:  # noqa: BLE001
        for v in timed:
            results[v].error = f"timing: {type(e).__name__}: {str(e)[:300]}"
        best = {}
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(cfg).parameters())
    for name, ms in best.items():
        results[name].step_ms = ms
        results[name].tokens_per_s = batch * dist.get_world_size() * cfg.seq_len / (ms / 1e3)
        results[name].tflops = _flops_per_step(cfg, batch, params) / (ms / 1e3) / 1e12
    return list(results.values())


# --------------------------------------------------------------------------- the two parts

def _init_group(backend: str, rank: int, world: int, init_file: str) -> None:
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))


def world1(options: argparse.Namespace) -> list[VariantResult]:
    device = torch.device(options.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    configs = QUICK if options.quick else {c: CONFIGS[c] for c in options.configs}
    with tempfile.TemporaryDirectory() as tmp:
        _init_group(backend, 0, 1, os.path.join(tmp, "rendezvous"))
        try:
            results = []
            for name, (cfg, batch) in configs.items():
                print(f"world1 {name}: measuring", flush=True)
                variants = list(VARIANTS) + (["floor"] if name in FLOOR_CONFIGS else [])
                results += measure_config(name, cfg, batch, device, variants, options)
            return results
        finally:
            dist.destroy_process_group()


def _world2_rank(rank: int, world: int, init_file: str, options: argparse.Namespace,
                 queue) -> None:
    device = torch.device(options.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)  # both ranks share the first GPU
    try:
        _init_group("cpu:gloo,cuda:gloo" if device.type == "cuda" else "gloo", rank, world,
                    init_file)
        cfg, batch = QUICK["gpt-tiny"] if options.quick else WORLD2_CONFIG
        results = measure_config("world2-gpt", cfg, batch, device,
                                 ["fsdp_compose", "fsdp2"], options, bf16=False)
        reference = None
        if rank == 0:  # one process on the global batch, fp32
            reference = _one_process_losses(cfg, batch * world, device, options.memory_steps)
        queue.put((rank, [asdict(r) for r in results], reference))
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - the parent reports it
        queue.put((rank, None, f"{type(e).__name__}: {e}"))


def _one_process_losses(cfg: GPTConfig, batch: int, device: torch.device, steps: int
                        ) -> list[float]:
    torch.manual_seed(0)
    with device:
        model = GPT(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return train_losses(model, optim, _batches(cfg, batch, device, steps))


def world2(options: argparse.Namespace) -> tuple[list[dict], list[float], list]:
    """(rank 0's results, the one-process losses, per-rank results)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_world2_rank, args=(r, 2, init_file, options, queue))
                 for r in range(2)]
        for p in procs:
            p.start()
        replies = sorted(queue.get(timeout=options.world2_timeout) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    for rank, results, extra in replies:
        if results is None:
            raise RuntimeError(f"world2 rank {rank}: {extra}")
    return replies[0][1], replies[0][2], [r[1] for r in replies]


# --------------------------------------------------------------------------- report

def _fmt(value: Optional[float], spec: str = ".1f") -> str:
    return "-" if value is None or value != value else format(value, spec)


def print_world1(results: list[VariantResult]) -> None:
    print(f"\n{'config':12} {'variant':13} {'step ms':>8} {'vs unsh':>8} {'tok/s':>9} "
          f"{'TFLOP/s':>8} {'peak GiB step1 f/b/o':>21} {'peak GiB last f/b/o':>20} "
          f"{'requested last f/b/o':>21}  losses")
    base = {r.config: r.step_ms for r in results if r.variant == "unsharded"}
    for r in results:
        first = r.memory[0] if r.memory else None
        last = r.memory[-1] if r.memory else None
        mem = lambda m: "-" if m is None else f"{m.forward:.2f}/{m.backward:.2f}/{m.optimizer:.2f}"
        req = lambda m: "-" if m is None else \
            f"{m.requested_forward:.2f}/{m.requested_backward:.2f}/{m.requested_optimizer:.2f}"
        ratio = r.step_ms / base[r.config] if r.step_ms and base.get(r.config) else None
        print(f"{r.config:12} {r.variant:13} {_fmt(r.step_ms):>8} {_fmt(ratio, '.3f'):>8} "
              f"{_fmt(r.tokens_per_s, '.0f'):>9} {_fmt(r.tflops):>8} {mem(first):>21} "
              f"{mem(last):>20} {req(last):>21}  {' '.join(f'{v:.4f}' for v in r.losses[:4])}"
              + (f"  ERROR {r.error}" if r.error else ""))


def print_world2(results: list[dict], reference: list[float], per_rank: list) -> None:
    print("\nworld2 (2 ranks sharing one device over gloo, fp32)")
    for r in results:
        diff = max((abs(a - b) for a, b in zip(r["losses"], reference)), default=float("nan"))
        peaks = [max((m["backward"] for m in rank_results[i]["memory"]), default=float("nan"))
                 for rank_results in per_rank for i, x in enumerate(rank_results)
                 if x["variant"] == r["variant"]]
        print(f"  {r['variant']:13} step {_fmt(r['step_ms'])} ms, max |loss - one process| "
              f"{diff:.2e} over {len(reference)} steps, backward peak per rank "
              f"{', '.join(_fmt(p, '.2f') for p in peaks)} GiB"
              + (f"  ERROR {r['error']}" if r["error"] else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--only", choices=["world1", "world2"], default=None)
    parser.add_argument("--configs", nargs="+", default=["gpt-782m", "many-small"],
                        choices=sorted(CONFIGS))
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, few steps")
    parser.add_argument("--memory-steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--world2-timeout", type=float, default=600.0)
    parser.add_argument("--json", default=None, help="write every number to this file")
    options = parser.parse_args()
    if options.quick:
        options.memory_steps, options.rounds, options.steps = 3, 2, 3
    if options.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu: no CUDA device visible (--device cpu runs the logic)")
    device_name = torch.cuda.get_device_name() if options.device == "cuda" else "cpu"
    print(f"device {device_name}, torch {torch.__version__}"
          + (f", NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
             if options.device == "cuda" else ""), flush=True)
    out: dict = {"device": device_name, "torch": torch.__version__}
    if options.only in (None, "world1"):
        begin = time.perf_counter()
        results = world1(options)
        print_world1(results)
        print(f"(world1: {time.perf_counter() - begin:.0f} s)", flush=True)
        out["world1"] = [asdict(r) for r in results]
    if options.only in (None, "world2"):
        begin = time.perf_counter()
        results2, reference, per_rank = world2(options)
        print_world2(results2, reference, per_rank)
        print(f"(world2: {time.perf_counter() - begin:.0f} s)", flush=True)
        out["world2"] = {"rank0": results2, "one_process_losses": reference, "per_rank": per_rank}
    if options.json:
        with open(options.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
