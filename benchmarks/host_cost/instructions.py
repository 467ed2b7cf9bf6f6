"""Host cost per unit as instructions: the host-cost proxy counted, not timed.

    PYTHONPATH=. .venv/bin/python -m benchmarks.host_cost.instructions            # needs valgrind
    PYTHONPATH=. .venv/bin/python -m benchmarks.host_cost.instructions --impls unsharded,fsdp_compose
    PYTHONPATH=. .venv/bin/python -m benchmarks.host_cost.instructions --cache   # + simulated caches

``benchmarks/host_cost/proxy.py`` times the proxy (one process, a GPT of 48 tiny
blocks, every block a unit); on a shared VM its ratios move by ±0.05 from
run to run, as much as the changes it should judge. This counts the
instructions the process executes instead, under valgrind's callgrind,
which no other load on the machine changes. Each implementation runs in
two processes, ``--short`` and ``--long`` steps after the same warm-up; the
difference divided by the difference in steps is the instructions of one
step, free of the start-up (importing torch) that both share. That
start-up varies by a few million instructions from process to process
(gloo's threads, the allocator), hence many steps between the two
(``--long 6`` left about ±1 M per step); hashing is seeded alike in each.
Runs ``--jobs`` processes at a time; each takes minutes (valgrind runs the
interpreter about 50x slower).

An instruction is not a nanosecond (cache misses, allocation, branch
prediction differ), so this ranks changes of the host path; the time
table stays ``proxy.py``'s. ``--cache`` also simulates the caches
(valgrind's model, about twice as slow): data reads and writes, and misses
of the first and the last level, per step.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

WARMUP = 3
EVENTS = re.compile(r"Events\s*: ([\w ]+)")
COLLECTED = re.compile(r"Collected : ([\d ]+)")


def _child(name: str, steps: int, layers: int) -> None:
    """Build ``name``'s proxy model, warm it up, run ``steps`` steps."""
    import torch
    import torch.distributed as dist

    from benchmarks.host_cost.proxy import _build, _stepper
    from fsdp_compose.testing import GPTConfig, synthetic_tokens

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=layers)
    with tempfile.TemporaryDirectory() as tmp:  # the file store removes its file at the end
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}",
                                rank=0, world_size=1)
        x, y = synthetic_tokens(0, 2, cfg.seq_len, cfg.vocab_size)
        cpu = torch.device("cpu")
        step = _stepper(_build(name, cfg, cpu), x, y, cpu, time.thread_time)
        for _ in range(WARMUP + steps):
            step()
        dist.destroy_process_group()


def _count(name: str, steps: int, layers: int, cache: bool) -> dict[str, int]:
    """Callgrind's events (``Ir``: instructions; with ``cache``, also the
    simulated cache's reads, writes and misses) of a child process running
    ``steps`` steps of ``name``."""
    command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
               f"--cache-sim={'yes' if cache else 'no'}",
               sys.executable, "-m", "benchmarks.host_cost.instructions",
               "--child", name, str(steps), "--layers", str(layers)]
    environment = dict(os.environ, PYTHONHASHSEED="0")  # the same dict and set layouts each run
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=environment)
    events, found = EVENTS.search(done.stderr), COLLECTED.search(done.stderr)
    if done.returncode != 0 or events is None or found is None:
        raise RuntimeError(f"{name}, {steps} steps under callgrind failed "
                           f"(exit {done.returncode}):\n{done.stderr[-3000:]}")
    return dict(zip(events.group(1).split(), map(int, found.group(1).split())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", default="unsharded,fsdp_compose",
                        help="comma-separated, of unsharded, fsdp_compose, fsdp2")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--short", type=int, default=1)
    parser.add_argument("--long", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cache", action="store_true",
                        help="also simulate the caches: data reads and misses per step")
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "STEPS"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        _child(options.child[0], int(options.child[1]), options.layers)
        return
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (this benchmark counts instructions under "
                     "callgrind); benchmarks/host_cost/proxy.py times the same proxy")
    names = options.impls.split(",")
    runs = [(name, steps) for name in names for steps in (options.short, options.long)]
    with ThreadPoolExecutor(options.jobs) as pool:
        counts = dict(zip(runs, pool.map(
            lambda run: _count(*run, options.layers, options.cache), runs)))

    def per_step(name: str, event: str = "Ir") -> float:
        return (counts[name, options.long][event] - counts[name, options.short][event]) \
            / (options.long - options.short)

    units = options.layers + 1
    print(f"GPT {options.layers} blocks d=16 seq 8 batch 2 on cpu, {units} units; instructions "
          f"per step (callgrind, {options.long} - {options.short} steps after {WARMUP} warm-up)")
    print("| variant | M instructions per step | x unsharded | k instructions per unit per step "
          "over unsharded |")
    print("|---|---|---|---|")
    base = per_step("unsharded") if "unsharded" in names else None
    for name in names:
        ratio = f"{per_step(name) / base:.3f}" if base else "-"
        extra = f"{(per_step(name) - base) / units / 1e3:.0f}" if base and name != "unsharded" \
            else "-"
        print(f"| {name} | {per_step(name) / 1e6:.1f} | {ratio} | {extra} |")
    if options.cache:
        print("\nsimulated caches, per step (M): data reads, writes, first-level misses, "
              "last-level misses")
        for name in names:
            print(f"  {name:14} Dr {per_step(name, 'Dr') / 1e6:7.1f}  Dw {per_step(name, 'Dw') / 1e6:7.1f}"
                  f"  D1 misses {(per_step(name, 'D1mr') + per_step(name, 'D1mw')) / 1e6:6.2f}"
                  f"  LL misses {(per_step(name, 'DLmr') + per_step(name, 'DLmw')) / 1e6:6.3f}"
                  f"  I1 misses {per_step(name, 'I1mr') / 1e6:6.2f}")


if __name__ == "__main__":
    main()
