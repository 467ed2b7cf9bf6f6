"""Micro-benchmark: per-unit CPU overhead of the hooks, at world size 1.

    PYTHONPATH=. .venv/bin/python -m benchmarks.hooks_micro            # gc on, then gc off
    PYTHONPATH=. .venv/bin/python -m benchmarks.hooks_micro --units 200 --width 8 --rounds 15
    PYTHONPATH=. .venv/bin/python -m benchmarks.hooks_micro --gc off   # one mode only

One process (gloo group of one rank, one thread), a chain of ``--units`` tiny
``Linear(width, width) + tanh`` modules, each its own unit, plus the root.
A step is forward + backward + ``zero_grad(set_to_none=True)`` (no optimizer:
its cost differs between flat shards and DTensors and is not hook work).
fsdp_compose, torch FSDP2 and the plain model (no wrapper) run round-robin;
µs per unit per step = (median step - plain model's median step) / units.
At world size 1 nothing is communicated, so what is left is the Python work
of the hooks, the views and the bookkeeping of each unit (and, with the
garbage collector on, the share of Python's garbage collections that the
objects they allocate trigger). Both modes are measured by default, one
table each, with the ratio to FSDP2 (issue 22's target: at most 0.35).
fsdp_compose runs with its defaults, bucketing on: the plan's bookkeeping
is counted here; at world size 1 nothing is gathered, so no unit qualifies
for a bucket.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def _chain(units: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                           for _ in range(units)])


def _fsdp_compose(model: nn.Sequential) -> nn.Module:
    from fsdp_compose import fully_shard
    for block in model:
        fully_shard(block)
    return fully_shard(model)


def _fsdp2(model: nn.Sequential) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (1,))
    for block in model:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


BUILDERS = {"fsdp_compose": _fsdp_compose, "fsdp2": _fsdp2, "plain": lambda m: m}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--units", type=int, default=100)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--gc", choices=["both", "on", "off"], default="both",
                   help="Python's cyclic garbage collector while timing: on, off, or both "
                        "(default; its full collections scan every live object and fire "
                        "every few steps, which weighs on the per-unit figure of every impl)")
    p.add_argument("--no-gc", action="store_true", help="the same as --gc off")
    args = p.parse_args()
    modes = ["off"] if args.no_gc else (["on", "off"] if args.gc == "both" else [args.gc])
    torch.set_num_threads(1)
    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
        models = {name: build(_chain(args.units, args.width)) for name, build in BUILDERS.items()}
        x = torch.randn(args.batch, args.width)

        def step(model: nn.Module) -> float:
            t0 = time.perf_counter()
            model(x).sum().backward()
            for param in model.parameters():
                param.grad = None
            return time.perf_counter() - t0

        for model in models.values():
            for _ in range(3):
                step(model)  # warm-up, lazy init
        names = list(models)
        results = {}
        for mode in modes:
            times = {name: [] for name in models}
            gc.collect()
            if mode == "off":
                gc.disable()
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    times[name].append(statistics.median(step(models[name])
                                                         for _ in range(args.steps)))
            gc.enable()
            results[mode] = times
        dist.destroy_process_group()
    for mode, times in results.items():
        med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        per_unit = {n: (med[n] - med["plain"]) * 1e3 / (args.units + 1) for n in med}
        print(f"{args.units} units + root, Linear({args.width}, {args.width}), batch {args.batch}, "
              f"{args.rounds} rounds x {args.steps} steps, gc {mode}; load average (1 min) "
              f"{os.getloadavg()[0]:.2f}")
        print("| impl | step ms (median) | µs per unit per step over plain | x FSDP2 |")
        print("|---|---|---|---|")
        for name in names:
            ratio = per_unit[name] / per_unit["fsdp2"] if per_unit["fsdp2"] > 0 else float("nan")
            print(f"| {name} | {med[name]:.2f} | {per_unit[name]:.0f} | "
                  f"{'-' if name == 'plain' else f'{ratio:.2f}'} |")
        print()


if __name__ == "__main__":
    main()
