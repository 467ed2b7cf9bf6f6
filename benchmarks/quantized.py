"""Quantized collectives (``CommPolicy``): convergence and bytes on the wire.

    .venv/bin/python -m benchmarks.quantized                  # 300 steps, ~5 min on 2 cores
    .venv/bin/python -m benchmarks.quantized --steps 20       # smoke run
    .venv/bin/python -m benchmarks.quantized --replot         # the plot again, from the JSON

Two gloo ranks train the demo's GPT (``examples/train_gpt.py``'s defaults:
4 layers, width 128, 4 heads, vocabulary 1024, sequence 64, 4 rows per
rank; AdamW, lr 1e-3, the same seed and data) once per mode, exact first:
exact collectives, int8 all-gather, int8 all-gather and reduction, fp8
(e4m3) both. It counts the bytes each rank sends in one step's collectives (the
fourth step, bucketed; ``F - 1`` chunks of ``F`` per all-gather,
reduce-scatter and all-to-all), reports the final loss (mean of the last 10
steps) against the exact run's, and writes
``benchmarks/results/quantized.json`` and ``quantized.png`` (the loss
curves, when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from benchmarks._two_ranks import join_gloo_group, run_two_ranks
from benchmarks.impls import QUANTIZED_MODES, quantized_comm_policy
from fsdp_compose import fully_shard
from fsdp_compose.testing import GPT, GPTConfig, synthetic_tokens

MODES = ("exact",) + QUANTIZED_MODES
RESULTS = os.path.join(os.path.dirname(__file__), "results")


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out-dir", default=RESULTS)
    return parser.parse_args()


def _train(mode: str, steps: int, rank: int, world: int) -> dict:
    from tests._comm_counter import CollectiveCounter  # counts c10d ops independently of us
    cfg = GPTConfig(vocab_size=1024, seq_len=64, d_model=128, n_heads=4, n_layers=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    policy = quantized_comm_policy(None if mode == "exact" else mode)
    for block in model.blocks:
        fully_shard(block, comm_policy=policy)
    fully_shard(model, comm_policy=policy)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, wire = [], {}
    rows = 4
    for step in range(steps):
        x, y = synthetic_tokens(step, rows * world, cfg.seq_len, cfg.vocab_size, seed=0)
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        # step 3 is bucketed by then: its collectives are counted (the portable reduce-scatter)
        counter = CollectiveCounter() if step == 3 else contextlib.nullcontext()
        with counter:
            loss = model.loss(x, y)
            loss.backward()
        if step == 3:
            wire = {_name(op): n * _sent_per_output_byte(op, world)
                    for op, n in counter.bytes.items()}
        optim.step()
        optim.zero_grad()
        mean = loss.detach()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    return {"losses": losses, "bytes": wire}


def _name(op) -> str:
    return str(op).split(".")[1].strip("_").replace("_base", "")


def _sent_per_output_byte(op, world: int) -> float:
    """Bytes a rank sends per byte of the op's output tensor, as a ring or
    pairwise exchange does: an all-gather's or all-to-all's output is ``F``
    chunks, ``F - 1`` of them from other ranks; a reduce-scatter's is one
    chunk of an input of ``F``, ``F - 1`` of which leave the rank."""
    return world - 1 if _name(op) == "reduce_scatter" else (world - 1) / world


def _worker(rank: int, world: int, init_file: str, args: argparse.Namespace, queue) -> None:
    join_gloo_group(rank, world, init_file, timeout_s=600)
    results = {mode: _train(mode, args.steps, rank, world) for mode in MODES}
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    args = _arguments()
    results = run_two_ranks(_worker, args, timeout=3600)
    exact = results["exact"]
    tail = min(10, args.steps)
    exact_final = sum(exact["losses"][-tail:]) / tail
    print(f"| mode | final loss (last {tail}) | vs exact | bytes per step per rank | vs exact |")
    print("| --- | --- | --- | --- | --- |")
    summary = {}
    for mode in MODES:
        res = results[mode]
        final = sum(res["losses"][-tail:]) / tail
        moved = round(sum(res["bytes"].values()))
        summary[mode] = {"final_loss": final, "bytes": res["bytes"], "bytes_total": moved,
                         "losses": res["losses"]}
        print(f"| {mode} | {final:.4f} | {final / exact_final - 1:+.2%} | {moved:,} | "
              f"{moved / sum(exact['bytes'].values()):.3f} |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "quantized.json"), "w") as f:
        json.dump({"commit": commit, "steps": args.steps, "modes": summary}, f, indent=1)
    _plot(summary, os.path.join(args.out_dir, "quantized.png"))


def _plot(summary: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, (ax, diff) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    exact = summary["exact"]["losses"]
    for mode, res in summary.items():
        steps = range(1, len(res["losses"]) + 1)
        ax.plot(steps, res["losses"], label=mode, linewidth=1)
        diff.plot(steps, [a - b for a, b in zip(res["losses"], exact)], label=mode, linewidth=1)
    ax.set_ylabel("loss (mean over 2 ranks)")
    ax.set_yscale("log")
    ax.set_title("demo GPT, 2 gloo ranks: exact vs quantized collectives")
    ax.legend()
    diff.set_xlabel("step")
    diff.set_ylabel("loss minus the exact run's")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--replot"]:  # from the JSON of an earlier run
        with open(os.path.join(RESULTS, "quantized.json")) as f:
            _plot(json.load(f)["modes"], os.path.join(RESULTS, "quantized.png"))
    else:
        main()
