"""Muon on shards: step time of torch's ``Muon`` on the blocks' weight
matrices (AdamW on the rest) with placement ``"owned"`` (each matrix whole
on one rank: its Newton–Schulz iterations run there only), against the same
optimizers under DDP (every rank orthogonalises every matrix, as one
process would) and against AdamW alone on ``"flat"`` shards; the
benchmark's default GPT on 2 CPU ranks, variants interleaved round by round.

    .venv/bin/python -m benchmarks.muon             # ~3 min on 2 cores
    .venv/bin/python -m benchmarks.muon --layers 2 --d-model 128 --heads 4 --vocab 1024 --repeats 3

Per variant: the median step (forward, backward, optimizer step; max over
ranks) and the median optimizer step alone, in ms, and their ratio to
AdamW on flat shards.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp_compose.testing import GPT, GPTConfig, synthetic_tokens

from benchmarks._two_ranks import (gpt_arguments, gpt_config, join_gloo_group,
                                    run_two_ranks)

VARIANTS = ("fsdp_compose owned, Muon + AdamW", "ddp, Muon + AdamW", "fsdp_compose flat, AdamW")
ROWS_PER_RANK = 2


def _build(cfg: GPTConfig, variant: str):
    """The model and its optimizers for ``variant``."""
    torch.manual_seed(0)
    model = GPT(cfg)
    muon = "Muon" in variant
    if variant.startswith("fsdp_compose"):
        from fsdp_compose import fully_shard
        for block in model.blocks:
            fully_shard(block, shard_placement_fn=(lambda p: "owned" if p.ndim == 2 else None)
                        if muon else None)
        fully_shard(model)
        model.set_check_rank_divergence(False)  # time the steady state
        blocks = model.blocks
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        blocks = model.module.blocks
    matrices = [p for p in blocks.parameters() if p.ndim == 2] if muon else []
    taken = {id(p) for p in matrices}
    optims = [torch.optim.AdamW([p for p in model.parameters() if id(p) not in taken], lr=2e-4)]
    if matrices:
        optims.append(torch.optim.Muon(matrices, lr=0.02, adjust_lr_fn="match_rms_adamw"))
    return model, optims


def _step(model, optims, cfg: GPTConfig, step: int, rank: int, world: int) -> tuple[float, float]:
    """One training step; (its seconds, the optimizer step's seconds), max over ranks."""
    x, y = synthetic_tokens(step, ROWS_PER_RANK * world, cfg.seq_len, cfg.vocab_size)
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    dist.barrier()
    start = time.perf_counter()
    logits = model(x[rows])
    F.cross_entropy(logits.flatten(0, 1), y[rows].flatten()).backward()
    before_optim = time.perf_counter()
    for optim in optims:
        optim.step()
        optim.zero_grad()
    end = time.perf_counter()
    times = torch.tensor([end - start, end - before_optim])
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times[0].item(), times[1].item()


def _worker(rank: int, world: int, init_file: str, args: argparse.Namespace, queue) -> None:
    join_gloo_group(rank, world, init_file, timeout_s=600)
    cfg = gpt_config(args)
    built = {v: _build(cfg, v) for v in VARIANTS}
    for v, (model, optims) in built.items():  # warm-up: the first steps set things up
        for step in range(2):
            _step(model, optims, cfg, step, rank, world)
    steps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    optim_steps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for round_ in range(args.repeats):
        for v, (model, optims) in built.items():
            total, optim = _step(model, optims, cfg, 2 + round_, rank, world)
            steps[v].append(total)
            optim_steps[v].append(optim)
    if rank == 0:
        queue.put({v: (statistics.median(steps[v]) * 1000, statistics.median(optim_steps[v]) * 1000)
                   for v in VARIANTS})
    dist.destroy_process_group()


def main() -> None:
    args = gpt_arguments(__doc__.splitlines()[0], repeats=8)
    results = run_two_ranks(_worker, args, timeout=1800)
    base_step, base_optim = results[VARIANTS[-1]]
    print(f"GPT {args.layers} layers d{args.d_model} vocab {args.vocab}, 2 gloo ranks, "
          f"{args.repeats} interleaved rounds (medians, max over ranks)")
    print("| variant | step ms | x AdamW flat | optimizer step ms | x AdamW flat |")
    print("|---|---|---|---|---|")
    for v, (step_ms, optim_ms) in results.items():
        print(f"| {v} | {step_ms:.0f} | {step_ms / base_step:.2f} | {optim_ms:.0f} | "
              f"{optim_ms / base_optim:.2f} |")


if __name__ == "__main__":
    main()
