"""Cost of routing torch's ``clip_grad_norm_`` / ``get_total_norm`` through
fsdp_compose's global norms (``fsdp_compose/torch_norms.py``), 2 CPU ranks.

    .venv/bin/python -m benchmarks.torch_norms                 # ~1 min
    .venv/bin/python -m benchmarks.torch_norms --layers 48 --d-model 64 --heads 4 --vocab 512

On the benchmark GPT annotated per block, after one forward/backward, each
rank times (median over ``--repeats``, max over ranks, a barrier before each):

* ``optim.step()`` (AdamW) with the routing on and off, alternating: the
  routing touches nothing outside the two norm functions, so these must agree
  within noise;
* the clip + step of a training loop: torch's (routed) ``clip_grad_norm_``
  against ``fsdp_compose.clip_grad_norm_``, and torch's (routed)
  ``get_total_norm`` against the same norm computed directly;
* torch's ``clip_grad_norm_`` on an unannotated copy of the model (routing
  on: the recognition finds nothing and falls through; off: torch's code).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

import torch
import torch.distributed as dist

from fsdp_compose.testing import GPT, synthetic_tokens

from benchmarks._two_ranks import (gpt_arguments, gpt_config, join_gloo_group,
                                    run_two_ranks)


def _time(fn: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item() * 1000


def _alternating(cases: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms of each case, the cases interleaved in a new order every
    repeat (the same on every rank), so drift and cache effects of the
    previous case hit all alike."""
    from fsdp_compose import route_torch_grad_norms
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(repeats):
        order = list(cases)
        random.Random(i).shuffle(order)
        for name in order:
            fn = cases[name]
            route_torch_grad_norms(not name.endswith("(routing off)"))
            times[name].append(_time(fn))
    route_torch_grad_norms(True)
    return {name: statistics.median(t) for name, t in times.items()}


def _recognition_ms(params: list, grads: list, plain: torch.nn.Module,
                    loops: int = 2000) -> dict[str, float]:
    """What the routing adds to a call, without the norm itself or any
    collective: finding the managed parameters / gradients (best of 5)."""
    from fsdp_compose import torch_norms
    from fsdp_compose.runtime.owners import owner_of

    def best(fn: Callable[[], object]) -> float:
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(loops):
                fn()
            runs.append((time.perf_counter() - start) / loops * 1000)
        return min(runs)

    plain_params = list(plain.parameters())
    plain_grads = [p.grad for p in plain_params]
    return {
        "recognition only, clip_grad_norm_, annotated model":
            best(lambda: any(owner_of(p) is not None for p in params)),
        "recognition only, clip_grad_norm_, unannotated model":
            best(lambda: any(owner_of(p) is not None for p in plain_params)),
        "recognition only, get_total_norm, annotated model":
            best(lambda: torch_norms._managed_params_of(grads)),
        "recognition only, get_total_norm, unannotated model":
            best(lambda: torch_norms._managed_params_of(plain_grads)),
    }


def _worker(rank: int, world: int, init_file: str, args: argparse.Namespace, queue) -> None:
    join_gloo_group(rank, world, init_file, timeout_s=300)
    from fsdp_compose import clip_grad_norm_, fully_shard
    from fsdp_compose.gradients.clip import total_norm_over_ranks
    cfg = gpt_config(args)
    torch.manual_seed(0)
    model = GPT(cfg)
    plain = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    x, y = synthetic_tokens(0, 2 * world, cfg.seq_len, cfg.vocab_size)
    for m, xs, ys in ((model, x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]),
                      (plain, x[:2], y[:2])):
        torch.nn.functional.cross_entropy(m(xs).flatten(0, 1), ys.flatten()).backward()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-9)
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    big = 1e9  # no clipping: only the norm and a no-op scale are timed
    cases = {
        "optim.step() (routing on)": optim.step,
        "optim.step() (routing off)": optim.step,
        "torch clip_grad_norm_ + step (routed)":
            lambda: (torch.nn.utils.clip_grad_norm_(params, big), optim.step()),
        "fsdp_compose.clip_grad_norm_ + step":
            lambda: (clip_grad_norm_(params, big), optim.step()),
        "torch get_total_norm (routed)": lambda: torch.nn.utils.get_total_norm(grads),
        "fsdp_compose total norm": lambda: total_norm_over_ranks(params),
        "unannotated model: torch clip_grad_norm_ (routing on)":
            lambda: torch.nn.utils.clip_grad_norm_(plain.parameters(), big),
        "unannotated model: torch clip_grad_norm_ (routing off)":
            lambda: torch.nn.utils.clip_grad_norm_(plain.parameters(), big),
    }
    for fn in cases.values():
        fn()  # warm up
    results = _alternating(cases, args.repeats)
    results.update(_recognition_ms(params, grads, plain))
    if rank == 0:
        queue.put({"results": results, "params": len(params),
                   "numel": sum(p.numel() for p in plain.parameters())})
    dist.destroy_process_group()


def main() -> None:
    args = gpt_arguments(__doc__.splitlines()[0], repeats=30)
    out = run_two_ranks(_worker, args, timeout=1200)
    print(f"GPT layers={args.layers} d_model={args.d_model} vocab={args.vocab}: "
          f"{out['params']} parameters, {out['numel'] / 1e6:.1f} M elements; 2 CPU ranks (gloo); "
          f"median of {args.repeats}, max over ranks")
    print("| what | ms |")
    print("|---|---|")
    for name, ms in out["results"].items():
        print(f"| {name} | {ms:.4f} |")


if __name__ == "__main__":
    main()
