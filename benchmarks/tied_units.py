"""Cost of a tied embedding and head across units: the benchmark GPT with
``tie_embeddings=True``, the tie in the root against the embedding a unit
of its own (the head in the root) and the embedding and the head each a
unit, with the owner resharding after forward (default) or kept
(``reshard_after_forward=False``), 2 CPU ranks.

    .venv/bin/python -m benchmarks.tied_units          # ~1 min
    .venv/bin/python -m benchmarks.tied_units --layers 4 --d-model 256 --vocab 8191

Each layout trains ``--repeats`` timed AdamW steps after two untimed ones
(forward, backward, step; max over ranks after a barrier, median over
steps); layouts are interleaved round by round, so that a change of the
machine's load reaches all of them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

import torch
import torch.distributed as dist

from fsdp_compose.testing import GPT, GPTConfig

from benchmarks._two_ranks import (gpt_arguments, gpt_config, join_gloo_group, run_two_ranks,
                                   timed_step)

LAYOUTS = ("tie in root", "embedding unit", "embedding unit, kept", "embedding and head units",
           "embedding and head units, kept")
ROUNDS = 3


def _model(cfg: GPTConfig, layout: str) -> GPT:
    from fsdp_compose import fully_shard
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**cfg.__dict__, "tie_embeddings": True}))
    kept = layout.endswith("kept")
    if layout != "tie in root":
        fully_shard(model.tok_emb, reshard_after_forward=not kept)
    for block in model.blocks:
        fully_shard(block)
    if "head" in layout:
        fully_shard(model.head, reshard_after_forward=not kept)
    fully_shard(model)
    model.set_check_rank_divergence(False)  # the steady state: no verified iterations
    return model


def _time_steps(model: GPT, cfg: GPTConfig, rank: int, world: int, repeats: int) -> list[float]:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(repeats + 2):
        elapsed = timed_step(model, optim, cfg, rank, world, step)
        if step >= 2:
            times.append(elapsed)
    return times


def _worker(rank: int, world: int, init_file: str, args: argparse.Namespace, queue) -> None:
    join_gloo_group(rank, world, init_file, timeout_s=300)
    cfg = gpt_config(args)
    times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for _ in range(ROUNDS):
        for layout in LAYOUTS:
            times[layout] += _time_steps(_model(cfg, layout), cfg, rank, world, args.repeats)
    if rank == 0:
        queue.put({layout: statistics.median(t) * 1000 for layout, t in times.items()})
    dist.destroy_process_group()


def main() -> None:
    args = gpt_arguments(__doc__.splitlines()[0], repeats=5)
    results = run_two_ranks(_worker, args, timeout=1800)
    base = results["tie in root"]
    print("| layout | step ms (median) | x tie in root |")
    print("|---|---|---|")
    for layout, ms in results.items():
        print(f"| {layout} | {ms:.1f} | {ms / base:.2f} |")


if __name__ == "__main__":
    main()
