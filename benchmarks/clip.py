"""Cost of gradient clipping across shards: ``fsdp_compose.clip_grad_norm_``
against ``torch.nn.utils.clip_grad_norm_`` on torch FSDP2 (DTensor gradients)
and on DDP (full gradients), on the default benchmark GPT, 2 CPU ranks.

    .venv/bin/python -m benchmarks.clip            # ~1 min
    .venv/bin/python -m benchmarks.clip --layers 48 --d-model 64 --heads 4 --vocab 512

Each rank runs one forward/backward to get gradients, then times the clip
call alone (``--repeats`` times, after a barrier each; max over ranks, median
over repeats). ``max_norm`` is large, so only the norm and the (no-op) scale
are measured, identically for all three.
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

from fsdp_compose.testing import GPT, GPTConfig, synthetic_tokens

from benchmarks._two_ranks import (gpt_arguments, gpt_config, join_gloo_group,
                                    run_two_ranks)


def _time_clip(clip, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        clip()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times) * 1000


def _model(cfg: GPTConfig, impl: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(cfg)
    if impl == "fsdp_compose":
        from fsdp_compose import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        # time the steady state: in verified iterations (the first two) every
        # clip_grad_norm_ also meets the ranks at the store ([Note: call rendezvous])
        model.set_check_rank_divergence(False)
    elif impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard as fsdp2
        for block in model.blocks:
            fsdp2(block)
        fsdp2(model)
    elif impl == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model


def _worker(rank: int, world: int, init_file: str, args: argparse.Namespace, queue) -> None:
    join_gloo_group(rank, world, init_file, timeout_s=120)
    cfg = gpt_config(args)
    results = {}
    for impl in ("fsdp_compose", "fsdp2", "ddp"):
        model = _model(cfg, impl)
        x, y = synthetic_tokens(0, 2 * world, cfg.seq_len, cfg.vocab_size)
        logits = model(x[rank * 2:(rank + 1) * 2])  # through DDP's forward: its hooks reduce
        torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                          y[rank * 2:(rank + 1) * 2].flatten()).backward()
        if impl == "fsdp_compose":
            from fsdp_compose import clip_grad_norm_
            norm = clip_grad_norm_(model, 1e9)
            results[impl] = (_time_clip(lambda: clip_grad_norm_(model, 1e9), args.repeats),
                             float(norm))
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            results[impl] = (_time_clip(
                lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9), args.repeats),
                float(norm))
        del model
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    args = gpt_arguments(__doc__.splitlines()[0], repeats=20)
    results = run_two_ranks(_worker, args, timeout=600)
    base = results["fsdp2"][0]
    print("| impl | clip_grad_norm_ ms (median) | x FSDP2 | total norm |")
    print("|---|---|---|---|")
    for impl, (ms, norm) in results.items():
        print(f"| {impl} | {ms:.2f} | {ms / base:.2f} | {norm:.6f} |")


if __name__ == "__main__":
    main()
