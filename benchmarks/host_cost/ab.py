"""Host cost per unit of this tree against another revision, paired step by step.

    PYTHONPATH=. .venv/bin/python -m benchmarks.host_cost.ab --baseline HEAD
    PYTHONPATH=. .venv/bin/python -m benchmarks.host_cost.ab --baseline 81cf3cb --pairs 600
    PYTHONPATH=. .venv/bin/python -m benchmarks.host_cost.ab --baseline HEAD --world 2

``benchmarks/host_cost/proxy.py`` compares fsdp_compose with the unsharded model,
the floor and FSDP2 on the host-cost proxy (one rank, a GPT of 48 tiny
blocks, every block a unit). Between two processes its ratios move by
about ±0.05, more than most single changes to the hooks, so judging a
change by two runs of it (before and after) mostly measures the machine.
This builds ``--baseline``'s ``fsdp_compose`` package (``git archive``,
renamed ``fsdp_compose_baseline`` so both import side by side) and this
tree's, annotates one model with each, and times single steps in turns
(baseline, this tree, unsharded; the order changed every turn), by this
thread's CPU clock. Each turn gives one difference per unit; the median
over ``--pairs`` turns, with its quartiles, is one process's reading.

Which model a process builds first matters by itself: the tree compared
with its own ``HEAD`` in one process that built the baseline's model first
read -7.6 µs per unit and step, a bias as large as
the changes this should judge. So the measurement runs in ``--processes``
processes, one after the other, half of them building the baseline's model
first and half this tree's; the result is the mean of the two orders'
readings, and half their difference (what the order alone does) is
printed with it. The paired medians of each variant's ratio to the
unsharded model are printed per process too (their difference is the
change; their level depends on three models sharing the caches).

``--world 2``: each measuring process is two gloo ranks, every unit sharded
over both (the collective path; one rank takes the local path); both ranks
run the same turns, rank 0 times them.
"""

from __future__ import annotations

import argparse
import datetime
import io
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks.host_cost.proxy import _build, _stepper
from fsdp_compose.testing import GPT, GPTConfig, synthetic_tokens

BASELINE_PACKAGE = "fsdp_compose_baseline"


def export_baseline(revision: str, into: str) -> None:
    """``revision``'s ``fsdp_compose`` as package :data:`BASELINE_PACKAGE` under ``into``."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                          text=True, check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", revision, "fsdp_compose"], cwd=root,
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        try:
            tar.extractall(into, filter="data")
        except TypeError:  # a Python without extraction filters (our own archive: trusted)
            tar.extractall(into)
    package = os.path.join(into, BASELINE_PACKAGE)
    os.rename(os.path.join(into, "fsdp_compose"), package)
    name = re.compile(r"\bfsdp_compose\b")
    for folder, _, files in os.walk(package):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(name.sub(BASELINE_PACKAGE, text))


def _baseline_model(cfg: GPTConfig) -> GPT:
    import importlib
    baseline = importlib.import_module(BASELINE_PACKAGE)
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        baseline.fully_shard(block)
    baseline.fully_shard(model)
    return model


def _measure(options: argparse.Namespace, folder: str, tree_first: bool) -> dict:
    """One process's turns (see the module docstring): the models built in
    the given order, then timed; the per-turn differences and ratios."""
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=options.layers)
    units = options.layers + 1
    device = torch.device("cpu")
    torch.set_num_threads(1)
    sys.path.insert(0, folder)
    dist.init_process_group("gloo", init_method=f"file://{options.init}", rank=options.rank,
                            world_size=options.world, timeout=datetime.timedelta(seconds=300))
    x, y = synthetic_tokens(options.rank, 2, cfg.seq_len, cfg.vocab_size)
    builders = {"baseline": lambda: _baseline_model(cfg),
                "this tree": lambda: _build("fsdp_compose", cfg, device)}
    order = ["this tree", "baseline"] if tree_first else ["baseline", "this tree"]
    models = {name: builders[name]() for name in order}
    models["unsharded"] = _build("unsharded", cfg, device)
    steps = {name: _stepper(model, x, y, device, time.thread_time)
             for name, model in models.items()}
    for step in steps.values():
        for _ in range(5):
            step()  # lazy initialisation, the verified iterations, optimizer state
    times: dict[str, list[float]] = {name: [] for name in steps}
    orders = list(itertools.permutations(steps))  # no variant always first or after another
    for turn in range(options.pairs):
        for name in orders[turn % len(orders)]:
            times[name].append(steps[name]())
    dist.destroy_process_group()
    saved = [(new - old) * 1e6 / units for new, old in zip(times["this tree"], times["baseline"])]
    ratio = {name: statistics.median(a / b for a, b in zip(times[name], times["unsharded"]))
             for name in ("baseline", "this tree")}
    return {"saved": saved, "ratio": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="HEAD", help="git revision to compare with")
    parser.add_argument("--pairs", type=int, default=400, help="turns of one step per process")
    parser.add_argument("--processes", type=int, default=2,
                        help="processes, one after the other, alternating which model is built "
                             "first (even: as many each way)")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--world", type=int, default=1,
                        help="gloo ranks per measuring process (2: the collective path)")
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--init", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=("baseline", "tree"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        print(json.dumps(_measure(options, options.folder, options.child == "tree")))
        return
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        export_baseline(options.baseline, folder)
        for index in range(options.processes):
            first = "baseline" if index % 2 == 0 else "tree"
            init = os.path.join(folder, f"rendezvous-{index}")
            ranks = [subprocess.Popen(
                [sys.executable, "-m", "benchmarks.host_cost.ab", "--pairs", str(options.pairs),
                 "--layers", str(options.layers), "--child", first, "--folder", folder,
                 "--world", str(options.world), "--rank", str(rank), "--init", init],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for rank in range(options.world)]
            outputs = [rank.communicate() for rank in ranks]
            if any(rank.returncode != 0 for rank in ranks):
                sys.exit("a measuring process failed:\n" +
                         "\n".join(err[-3000:] for _, err in outputs))
            runs.append((first, json.loads(outputs[0][0].strip().splitlines()[-1])))
    units = options.layers + 1
    print(f"host-cost proxy, {units} units, {options.world} rank(s), {options.processes} "
          f"processes x {options.pairs} "
          f"turns of one step each (thread CPU clock); torch {torch.__version__}; load average "
          f"(1 min) {os.getloadavg()[0]:.2f}")
    medians = {"baseline": [], "tree": []}
    for first, run in runs:
        median = statistics.median(run["saved"])
        low, _, high = statistics.quantiles(run["saved"], n=4)
        medians[first].append(median)
        print(f"  {first:>8} built first: this tree - {options.baseline}: {median:+.1f} µs per "
              f"unit and step (quartiles {low:+.1f} .. {high:+.1f}); x unsharded, paired "
              f"median: {options.baseline} {run['ratio']['baseline']:.3f}, this tree "
              f"{run['ratio']['this tree']:.3f}")
    if medians["baseline"] and medians["tree"]:
        each_way = [statistics.mean(medians["baseline"]), statistics.mean(medians["tree"])]
        print(f"this tree - {options.baseline}: {statistics.mean(each_way):+.1f} µs per unit and "
              f"step (the mean of both build orders); the build order alone moves it by "
              f"{(each_way[0] - each_way[1]) / 2:+.1f} (half the difference between the orders)")


if __name__ == "__main__":
    main()
