"""Cost of comparing training modes at the forward agreement: steps with the
units' training flags in the agreement's row against steps with a constant
in their place (everything else the same), paired, 2 CPU ranks.

    .venv/bin/python -m benchmarks.forward_agreement                   # the default model
    .venv/bin/python -m benchmarks.forward_agreement --layers 48 --d-model 64 --heads 4 --vocab 512

The two variants alternate step by step in one pair of processes, the
order swapped every pair, so a change of the machine's load reaches both;
each step is timed as the max over ranks after a barrier (forward,
backward, AdamW step). Printed: the median step of each variant, the
median of the paired differences with its quartiles, and the flags' own
host cost per root forward (the loop alone, timed over many calls).
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

from fsdp_compose.testing import GPT, GPTConfig

from benchmarks._two_ranks import (gpt_arguments, gpt_config, join_gloo_group, run_two_ranks,
                                   timed_step)


def _model(cfg: GPTConfig) -> GPT:
    from fsdp_compose import fully_shard
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _worker(rank: int, world: int, init_file: str, args: argparse.Namespace, queue) -> None:
    from fsdp_compose.checks.divergence import DivergenceMonitor
    from fsdp_compose.runtime.state import state_of
    join_gloo_group(rank, world, init_file, timeout_s=600)
    cfg = gpt_config(args)
    model = _model(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with_modes = DivergenceMonitor._training_modes
    variants = {"with": with_modes, "without": lambda self: 0}
    times: dict[str, list[float]] = {"with": [], "without": []}
    for step in range(3):  # warm-up
        timed_step(model, optim, cfg, rank, world, step)
    for pair in range(args.repeats):
        order = ("with", "without") if pair % 2 == 0 else ("without", "with")
        for name in order:
            DivergenceMonitor._training_modes = variants[name]  # type: ignore[method-assign]
            times[name].append(timed_step(model, optim, cfg, rank, world, 3 + pair))
    DivergenceMonitor._training_modes = with_modes  # type: ignore[method-assign]
    monitor = state_of(model).context.collectives.observer  # the model's DivergenceMonitor
    calls = 20000
    start = time.perf_counter()
    for _ in range(calls):
        monitor._training_modes()
    per_call = (time.perf_counter() - start) / calls
    if rank == 0:
        diffs = [a - b for a, b in zip(times["with"], times["without"])]
        q = statistics.quantiles(diffs, n=4)
        queue.put({"with": statistics.median(times["with"]) * 1e3,
                   "without": statistics.median(times["without"]) * 1e3,
                   "diff": (q[0] * 1e3, statistics.median(diffs) * 1e3, q[2] * 1e3),
                   "units": len(monitor._units), "per_call_us": per_call * 1e6})
    dist.destroy_process_group()


def main() -> None:
    args = gpt_arguments(__doc__.splitlines()[0], repeats=30)
    r = run_two_ranks(_worker, args, timeout=3600)
    print(f"{r['units']} units: step with {r['with']:.2f} ms, without {r['without']:.2f} ms "
          f"(medians); paired difference {r['diff'][1]:+.3f} ms "
          f"(quartiles {r['diff'][0]:+.3f} .. {r['diff'][2]:+.3f}); the flags alone "
          f"{r['per_call_us']:.2f} us per root forward")


if __name__ == "__main__":
    main()
