"""Host cost per unit: the CPU proxy of a launch-bound GPU step.

    PYTHONPATH=. .venv/bin/python -m benchmarks.host_cost                 # the table
    PYTHONPATH=. .venv/bin/python -m benchmarks.host_cost --profile 20    # + where the time goes
    PYTHONPATH=. .venv/bin/python -m benchmarks.host_cost --moments 20    # + each hook moment, timed
    PYTHONPATH=. .venv/bin/python -m benchmarks.host_cost --processes 5   # ratios across 5 processes
    python -m benchmarks.host_cost --device cuda                          # the same on a GPU
    PYTHONPATH=. .venv/bin/python -m benchmarks.host_cost --world 2       # two ranks

One process (a group of one rank: gloo on the CPU, NCCL on a GPU), one
thread, a GPT of ``--layers`` tiny blocks (d=16, sequence 8, batch 2: the
arithmetic is next to nothing), every block a unit plus the root. A step is
forward, backward, AdamW step and ``zero_grad``; every variant steps with torch's
own AdamW (the hooks are measured here, the flat optimizer step by
``benchmarks.optimizer_step``). The unsharded model,
the design's floor (``host_cost/floor.py``: the torch work
fsdp_compose's design needs per unit, with next to no Python), the same
with fsdp_compose's per-forward checks (``floor_checked``), fsdp_compose
and torch FSDP2 run in interleaved rounds; each round times
``--steps`` steps of each and keeps the median; the table shows the best
round's median, the ratio to the unsharded model, the host time per unit
per step over the unsharded model ((step - unsharded step) / units), and
the median over rounds of each round's ratio to the unsharded model's
median in the same round (variants adjacent in time: robust to a machine
whose speed drifts).
The target for fsdp_compose: at most 1.2x the unsharded model (about
130 µs per unit per step), on a quiet machine.

``--world 2``: two gloo ranks (this process and one it starts), every
unit sharded over both: the collective path every sharded job takes (the
queue, the wire, the observer, prefetching), where one rank takes the
local path. The variants are the unsharded model, fsdp_compose and FSDP2
(the floor is one rank's); rank 0's table is printed. Each rank trains on
its own batch; the arithmetic is still next to nothing, so the step is the
host's work plus the collectives' latency on gloo.

``--clock cpu``: time steps by this thread's CPU time instead of the wall
clock (the CPU proxy on a VM whose wall clock other tenants steal from).

``--processes N``: the whole benchmark in N fresh processes, one after the
other, then each variant's ratios across them: every process's best round
and median of rounds, and the median over processes of each. The
unsharded model's best round moves by over 10% from process to process
(where the allocator and the interpreter put things), which moves every
ratio of that process alike; one process is one sample of it. Process
``i`` builds the models starting from the ``i``-th variant (the unsharded
model first in the first process, the floor first in the second, ...):
the model a process builds first runs a few µs per unit slower by that
alone (``host_cost/ab.py``), so no variant is always first. With five
processes each variant is built first once.

``--profile N``: N more fsdp_compose steps under cProfile; the functions
with the most own time, and the time under each of the library's hook
moments (cumulative time of the functions that start them).

``--moments N``: N more steps of a new fsdp_compose model, and of a new
floor model, whose hook moments are timed by this thread's CPU clock, two
clock reads per moment and no profiler (cProfile charges every Python
call, which inflates the library's many small functions against torch's
C++): µs per unit and step of each moment for both, what fsdp_compose
spends over the floor in each, and what is left of fsdp_compose's excess
over the unsharded model outside the moments, which is torch's own work
for what the library adds (the views node, the flat gradient's
accumulation, the hooks' dispatch) plus the clock reads.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import inspect
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compose.testing import GPT, GPTConfig, synthetic_tokens

# The functions that start each hook moment: (file suffix, function name) -> label.
HOOK_MOMENTS = {
    ("runtime/state.py", "_pre_forward"): "pre-forward",
    ("runtime/state.py", "_post_forward"): "post-forward",
    ("runtime/unit.py", "pre_backward"): "pre-backward",
    ("runtime/unit.py", "_post_backward"): "post-backward",
    ("runtime/end_of_backward.py", "finish_backward"): "end of backward",
}


MOMENTS = ("pre-forward", "post-forward", "pre-backward", "views' backward", "post-backward",
           "end of backward")
"""The hook moments ``--moments`` times, in the order each variant lists its entry points."""


def _timed_moments(name: str) -> list[tuple[object, str, str]]:
    """(class, attribute, label): the entry point of each hook moment of
    variant ``name`` (``fsdp_compose`` or ``floor``), the views node's
    backward included, labelled as :data:`MOMENTS` (so both variants' rows
    pair up). Bound methods are taken when a model is annotated or a
    backward starts, so patch them before building the model that is timed."""
    if name == "floor":
        from benchmarks.host_cost.floor import FloorUnit, _Views
        entries = [(FloorUnit, "_pre_forward"), (FloorUnit, "_post_forward"),
                   (FloorUnit, "_pre_backward"), (_Views, "backward"),
                   (FloorUnit, "_take_gradient"), (FloorUnit, "_end_of_backward")]
    else:
        from fsdp_compose.buffers.param_views import SplitIntoParams
        from fsdp_compose.runtime.state import FullyShardState
        from fsdp_compose.runtime.unit import Unit
        entries = [(FullyShardState, "_pre_forward"), (FullyShardState, "_post_forward"),
                   (FullyShardState, "_pre_backward"), (SplitIntoParams, "backward"),
                   (Unit, "_post_backward"), (FullyShardState, "_finish_backward")]
    return [(owner, attribute, label) for (owner, attribute), label in zip(entries, MOMENTS)]


def _moment_times(name: str, cfg: GPTConfig, device: torch.device, x: torch.Tensor,
                  y: torch.Tensor, steps: int) -> dict[str, float]:
    """µs per unit and step of each hook moment of a new model of variant
    ``name``, each timed by two reads of this thread's CPU clock."""
    spent: dict[str, int] = {}
    originals = []
    for owner, attribute, label in _timed_moments(name):
        original = owner.__dict__[attribute]
        originals.append((owner, attribute, original))
        function = original.__func__ if isinstance(original, staticmethod) else original

        def timed(*args, _function=function, _label=label):
            begin = time.thread_time_ns()
            try:
                return _function(*args)
            finally:
                spent[_label] = spent.get(_label, 0) + time.thread_time_ns() - begin
        setattr(owner, attribute,
                staticmethod(timed) if isinstance(original, staticmethod) else timed)
    try:
        step = _stepper(_build(name, cfg, device), x, y, device, time.thread_time)
        for _ in range(3):
            step()
        spent.clear()
        for _ in range(steps):
            step()
    finally:
        for owner, attribute, original in originals:
            setattr(owner, attribute, original)
    units = cfg.n_layers + 1
    return {label: ns / 1e3 / steps / units for label, ns in spent.items()}


def _time_moments(cfg: GPTConfig, device: torch.device, x: torch.Tensor, y: torch.Tensor,
                  steps: int, excess_us: float) -> None:
    """``--moments``: new fsdp_compose and floor models, each hook moment timed."""
    library = _moment_times("fsdp_compose", cfg, device, x, y, steps)
    floor = _moment_times("floor", cfg, device, x, y, steps)
    print(f"\nhook moments, thread CPU time, {steps} steps (µs per unit per step; the floor "
          "does the same moment's torch work with next to no Python):")
    print(f"  {'moment':16} {'fsdp_compose':>12} {'floor':>7} {'over floor':>10}")
    for label, us in sorted(library.items(), key=lambda kv: -kv[1]):
        print(f"  {label:16} {us:12.1f} {floor.get(label, 0.0):7.1f} "
              f"{us - floor.get(label, 0.0):10.1f}")
    total, floor_total = sum(library.values()), sum(floor.values())
    print(f"  {'all moments':16} {total:12.1f} {floor_total:7.1f} {total - floor_total:10.1f}")
    print(f"  (fsdp_compose's excess over the unsharded model in the table: {excess_us:.0f}; "
          f"outside the moments, {excess_us - total:.0f}, is torch's work for the library)")


def _build(name: str, cfg: GPTConfig, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    with device:
        model = GPT(cfg)
    if name == "fsdp_compose":
        from fsdp_compose import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif name in ("floor", "floor_checked"):
        from benchmarks.host_cost.floor import floor_units
        floor_units(model, model.blocks, checked=name == "floor_checked")  # the hooks keep them
    elif name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def keep_torchs_step(optim: torch.optim.Optimizer) -> None:
    """Every fsdp_compose build loaded here (``ab.py``'s baseline too) leaves
    ``optim`` to torch's own step, as every variant's."""
    for name in ("fsdp_compose", "fsdp_compose_baseline"):
        flat_step = getattr(sys.modules.get(name), "flat_step", None)
        if flat_step is not None and "enabled" in inspect.signature(flat_step).parameters:
            flat_step(optim, enabled=False)


def _stepper(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
             device: torch.device, clock: Callable[[], float] = time.perf_counter
             ) -> Callable[[], float]:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    keep_torchs_step(optim)

    def step() -> float:
        begin = clock()
        model.loss(x, y).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return clock() - begin
    return step


def _profile(step: Callable[[], float], steps: int, units: int, top: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    moments: dict[str, float] = {}
    for (filename, _, function), (_, _, _, cumulative, _) in stats.stats.items():
        for (suffix, name), label in HOOK_MOMENTS.items():
            if function == name and filename.endswith(suffix):
                moments[label] = moments.get(label, 0.0) + cumulative
    print(f"\nfsdp_compose under cProfile, {steps} steps (cProfile slows every call; "
          "compare moments with each other, not with the table):")
    for label, seconds in sorted(moments.items(), key=lambda kv: -kv[1]):
        print(f"  {label:16} {seconds / steps / units * 1e6:8.1f} µs per unit per step")
    print(f"\nthe {top} functions with the most own time:")
    stats.sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--moments", type=int, default=0, metavar="N",
                        help="N more steps with each hook moment timed (no profiler)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="cpu: this thread's CPU time (CPU only; a busy or "
                             "oversubscribed VM steals wall time, not CPU time)")
    parser.add_argument("--processes", type=int, default=1, metavar="N",
                        help="run the benchmark in N fresh processes and summarise the ratios")
    parser.add_argument("--record", action="store_true",
                        help="with --processes: also write the table of record, "
                             "benchmarks/results/record/host-cost.json")
    parser.add_argument("--world", type=int, default=1, metavar="N",
                        help="N gloo ranks (this process is rank 0; CPU only)")
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--init", help=argparse.SUPPRESS)  # the ranks' rendezvous file
    parser.add_argument("--json", metavar="PATH", help=argparse.SUPPRESS)  # a child's ratios
    parser.add_argument("--build-first", type=int, default=0, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.processes > 1:
        _across_processes(options.processes, sys.argv[1:], options.record, options.world)
        return
    if options.record:
        parser.error("--record needs --processes N (the record is the median over processes)")
    device = torch.device(options.device)
    if options.clock == "cpu" and device.type != "cpu":
        parser.error("--clock cpu measures the host thread alone: use it with --device cpu")
    clock = time.thread_time if options.clock == "cpu" else time.perf_counter
    if options.world > 1 and device.type != "cpu":
        parser.error("--world N runs gloo ranks on the CPU")
    if options.world > 1 and (options.profile or options.moments):
        parser.error("--profile and --moments time one rank's extra steps: use --world 1")
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=options.layers)
    torch.set_num_threads(1)
    names = ["unsharded", "floor", "floor_checked", "fsdp_compose", "fsdp2"] \
        if options.world == 1 else ["unsharded", "fsdp_compose", "fsdp2"]
    with tempfile.TemporaryDirectory() as folder:
        init = options.init or os.path.join(folder, "rendezvous")
        helpers = [] if options.rank else [
            subprocess.Popen([sys.executable, "-m", "benchmarks.host_cost", *sys.argv[1:],
                              "--rank", str(rank), "--init", init], stdout=subprocess.DEVNULL)
            for rank in range(1, options.world)]
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{init}", rank=options.rank,
                                world_size=options.world, timeout=datetime.timedelta(seconds=300))
        x, y = (t.to(device) for t in synthetic_tokens(options.rank, 2, cfg.seq_len,
                                                        cfg.vocab_size))
        # built from the --build-first'th variant on (--processes rotates it: which model a
        # process builds first changes its speed by itself, see host_cost/ab.py)
        first = options.build_first % len(names)
        built = {name: _stepper(_build(name, cfg, device), x, y, device, clock)
                 for name in names[first:] + names[:first]}
        steppers = {name: built[name] for name in names}
        for step in steppers.values():
            for _ in range(3):
                step()  # warm-up: lazy initialisation, optimizer state
        rounds: dict[str, list[float]] = {name: [] for name in names}
        for r in range(options.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                gc.collect()
                rounds[name].append(statistics.median(steppers[name]() for _ in range(options.steps)))
        units = options.layers + 1
        if options.rank:
            dist.destroy_process_group()
            return  # rank 0 reports
        print(f"GPT {options.layers} blocks d={cfg.d_model} seq {cfg.seq_len} batch 2 on "
              f"{device.type} x {options.world} rank(s), {units} units; {options.rounds} interleaved rounds x "
              f"{options.steps} steps, best round's median ({options.clock} clock); "
              f"torch {torch.__version__}; "
              f"load average (1 min) {os.getloadavg()[0]:.2f}")
        print("| variant | step ms | x unsharded | µs per unit per step over unsharded "
              "| x unsharded, median of rounds (range) |")
        print("|---|---|---|---|---|")
        base = min(rounds["unsharded"]) * 1e3
        summary = {}
        for name in names:
            ms = min(rounds[name]) * 1e3
            ratios = [a / b for a, b in zip(rounds[name], rounds["unsharded"])]
            summary[name] = (ms / base, statistics.median(ratios))
            print(f"| {name} | {ms:.2f} | {ms / base:.2f} | "
                  f"{'-' if name == 'unsharded' else f'{(ms - base) * 1e3 / units:.0f}'} | "
                  f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f}) |")
        if options.json:
            with open(options.json, "w") as out:
                json.dump(summary, out)
        if options.profile:
            _profile(steppers["fsdp_compose"], options.profile, units, options.top)
        if options.moments:
            excess = (min(rounds["fsdp_compose"]) - min(rounds["unsharded"])) * 1e6 / units
            _time_moments(cfg, device, x, y, options.moments, excess)
        dist.destroy_process_group()
        for helper in helpers:
            helper.wait()


RECORD_LABELS = {"floor": "floor (the design's torch work only)",
                 "floor_checked": "floor_checked (the floor + fsdp_compose's per-forward checks)",
                 "fsdp2": "FSDP2"}
RECORD_NOTE = ("One process's best round moves by about 0.1 from process to process: compare "
               "changes with `python -m benchmarks.host_cost.ab --baseline REV --processes 4` "
               "(paired, build order alternated) or count instructions "
               "(`python -m benchmarks.host_cost.instructions`).")
RECORD_NOTE_RANKS = ("At several ranks a process's ratios move by far more, with the ranks' "
                     "waits on a small VM: compare changes with "
                     "`python -m benchmarks.host_cost.ab --baseline REV --processes 4 --world N` "
                     "(paired, build order alternated) or count calls "
                     "(`tests/runtime/test_host_calls.py`).")


def _across_processes(count: int, argv: list[str], record: bool = False,
                      world: int = 1) -> None:
    """Run this benchmark ``count`` times, each in a fresh process (its
    table printed as it comes; process ``i`` builds the ``i``-th variant's
    model first, and the others in order after it), then each variant's
    best-round ratio and median-of-rounds ratio per process, and the
    median over processes."""
    child = [a for i, a in enumerate(argv) if a != "--record"
             and not a.startswith("--processes") and not (i and argv[i - 1] == "--processes")]
    results: list[dict[str, list[float]]] = []
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory() as folder:
        for index in range(count):
            path = os.path.join(folder, f"{index}.json")
            subprocess.run([sys.executable, "-m", "benchmarks.host_cost", *child, "--json", path,
                            "--build-first", str(index)], check=True)
            with open(path) as f:
                results.append(json.load(f))
    print(f"\nacross {count} processes: x unsharded, best round / median of rounds per "
          "process; the median over processes of each")
    print("| variant | per process | median over processes |")
    print("|---|---|---|")
    rows = []
    for name in results[0]:
        best = [r[name][0] for r in results]
        median = [r[name][1] for r in results]
        each = ", ".join(f"{b:.2f}/{m:.2f}" for b, m in zip(best, median))
        overall = f"{statistics.median(best):.2f} / {statistics.median(median):.2f}"
        print(f"| {name} | {each} | {overall} |")
        rows.append([RECORD_LABELS.get(name, name), overall])
    if record:
        from benchmarks.record import write_record
        ranks = "one rank" if world == 1 else f"{world} ranks: the collective path"
        write_record("host-cost" if world == 1 else f"host-cost-{world}-ranks", order=4,
                     question="Host cost per unit: the CPU proxy of a launch-bound step "
                              f"(48 tiny blocks, {ranks})",
                     command="PYTHONPATH=. .venv/bin/python -m benchmarks.host_cost " + " ".join(argv),
                     calibration="DDP is not run by the proxy; its calibration is the unsharded "
                                 "model's step, to which every ratio is taken",
                     columns=["variant", f"x unsharded (best round / median of rounds, median "
                                         f"over {count} processes)"], rows=rows[1:],
                     notes=([] if load is None else [f"Load average {load:.2f} at the start."])
                     + [RECORD_NOTE if world == 1 else RECORD_NOTE_RANKS])


if __name__ == "__main__":
    main()
