"""Save and load time and memory of a sharded checkpoint: fsdp_compose (torch's
recipe and the zero-copy path) vs torch FSDP2, in one run, all through
torch.distributed.checkpoint (DCP) to local disk; and how long an async save
blocks the training loop.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.checkpoint            # default model
    torchrun --standalone --nproc-per-node 2 -m benchmarks.checkpoint --rounds 2 --layers 2
    torchrun --standalone --nproc-per-node 2 -m benchmarks.checkpoint --same-model --rounds 3
    torchrun --standalone --nproc-per-node 2 -m benchmarks.checkpoint --same-model --model large-vocab

``--model`` (:data:`MODELS`): ``default``, the 36M-parameter GPT (6 blocks
of width 512, vocabulary 16,384: the embedding and the head are 47% of the
parameters, ``benchmarks.run``'s default); ``large-vocab``, the same blocks
with GPT-2's vocabulary (50,304: 74%); ``many-small``, ``benchmarks.run``'s
48 blocks of width 64 (per-parameter work dominates).

``--same-model``: the saves of a training job instead: each implementation
is built once and trained one AdamW step, then each round times
``get_state_dict`` + ``dcp.save`` to a fresh directory, the implementations
alternating (the order turning each round); median over rounds and ranks,
with the ``get_state_dict`` part apart and each part's CPU time (the
process's, which machine load moves less than the wall clock).

After one unrecorded warm-up round (no implementation loads onto a cold
heap), each round builds each implementation afresh (interleaved, order
rotating), trains one step so AdamW has state, then times

* save: ``get_state_dict(model, optim)`` + ``dcp.save`` (the recipe in
  docs/checkpointing.md); ``fsdp_compose flat``: ``flat_state_dict`` +
  ``dcp.save(..., planner=FlatSavePlanner())``, and
* load: into a freshly built and annotated model and optimizer,
  ``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` (``flat``:
  ``flat_state_dict`` + ``dcp.load(..., planner=FlatLoadPlanner())`` +
  ``set_state_dict``),

each one's wall and CPU time (the process's, which machine load moves less
than the wall clock; medians over rounds and ranks), and the per-rank memory each adds: torch-allocated bytes are not tracked on
the CPU, so the measure is the process's resident-set high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs`` before each operation)
minus the resident set just before it, the median over rounds of the
largest rank (what the allocator kept free from earlier work moves it by
tens of MiB; ``tests/checkpoint/test_checkpoint_load_memory.py`` counts the tensor
bytes each phase allocates, which do not move). The loaded values are
checked equal to the saved ones.

Before each timed operation (both modes) every rank writes out the page
cache (``os.sync``, not timed): a save's ``fsync`` then waits for its own
bytes, not for what the implementation before it left dirty.

Async: ``CheckpointStore(async_save=True).save`` of the zero-copy state (the
time until it returns: the training loop's blocking time, staging included)
next to a synchronous ``CheckpointStore.save`` of the same state, and the
time the background save then needs to finish (``wait``).

Rank 0 prints a table and writes ``benchmarks/results/checkpoint.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fsdp_compose.checkpoint import (CheckpointStore, FlatLoadPlanner, FlatSavePlanner,
                                     flat_state_dict)
from fsdp_compose.testing import GPT, GPTConfig
from benchmarks.impls import BUILDERS

MODELS: dict[str, GPTConfig] = {
    # benchmarks.run's default: the 36M GPT, 6 blocks of width 512; the embedding
    # and the head are 47% of the parameters
    "default": GPTConfig(vocab_size=16384, seq_len=128, d_model=512, n_heads=8, n_layers=6),
    # GPT-2's vocabulary (padded to 64) on the same blocks: 70M, embedding and head 74%
    "large-vocab": GPTConfig(vocab_size=50304, seq_len=128, d_model=512, n_heads=8, n_layers=6),
    # benchmarks.run's many-small: 48 blocks of width 64, where per-parameter work dominates
    "many-small": GPTConfig(vocab_size=512, seq_len=128, d_model=64, n_heads=4, n_layers=48),
}
IMPLS = ("fsdp_compose", "fsdp_compose flat", "fsdp2")
FLAT = "fsdp_compose flat"
RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint.json"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class Measured(NamedTuple):
    seconds: float  # wall clock, the closing barrier included
    cpu_seconds: float  # this process's CPU time (machine load moves it less)
    rss_growth: int  # bytes


def settle_disk() -> None:
    """Write out what earlier rounds left in the page cache, on every rank,
    before the next timed operation: a save's ``fsync`` then waits for its
    own bytes only, not for the previous implementation's (which made the
    implementation timed second pay for the first)."""
    os.sync()
    dist.barrier()


def measured(fn: Callable[[], object]) -> Measured:
    """Wall and CPU seconds and resident-set growth of ``fn`` on this rank,
    after every rank is ready and the disk settled (neither is timed)."""
    gc.collect()
    settle_disk()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current VmRSS
    before = _status_kib("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    cpu = time.process_time() - cpu
    dist.barrier()
    seconds = time.perf_counter() - start
    return Measured(seconds, cpu, (_status_kib("VmHWM") - before) * 1024)


def build(cfg: GPTConfig, name: str, seed: int):
    torch.manual_seed(seed)
    model = BUILDERS[name.split()[0]](GPT(cfg))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optim


def train_one_step(cfg: GPTConfig, model, optim) -> None:
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(cfg.vocab_size, (2, cfg.seq_len), generator=g)
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), x.reshape(-1)).backward()
    optim.step()
    optim.zero_grad()


def full_values(model) -> dict[str, torch.Tensor]:
    msd, _ = get_state_dict(model, [])
    return {k: v.full_tensor() for k, v in msd.items()}


def one_round(cfg: GPTConfig, name: str, root: Path) -> dict[str, float]:
    model, optim = build(cfg, name, seed=1)
    train_one_step(cfg, model, optim)
    path = root / name
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()

    def save() -> None:
        if name == FLAT:
            msd, osd = flat_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path),
                     planner=FlatSavePlanner())
            return
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))

    saved_run = measured(save)
    saved = full_values(model)
    fresh, fresh_optim = build(cfg, name, seed=2)

    def load() -> None:
        if name == FLAT:
            msd, osd = flat_state_dict(fresh, fresh_optim)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(path),
                     planner=FlatLoadPlanner())
        else:
            msd, osd = get_state_dict(fresh, fresh_optim)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(path))
        set_state_dict(fresh, fresh_optim, model_state_dict=msd, optim_state_dict=osd)

    loaded_run = measured(load)
    loaded = full_values(fresh)
    if any(not torch.equal(loaded[k], saved[k]) for k in saved):
        raise AssertionError(f"{name}: loaded values differ from the saved ones")
    return {"save_s": saved_run.seconds, "save_cpu_s": saved_run.cpu_seconds,
            "save_rss_growth": saved_run.rss_growth,
            "load_s": loaded_run.seconds, "load_cpu_s": loaded_run.cpu_seconds,
            "load_rss_growth": loaded_run.rss_growth}


def async_round(cfg: GPTConfig, root: Path, stores: tuple[CheckpointStore, CheckpointStore],
                step: int) -> dict[str, float]:
    """Blocking time of an async save vs a synchronous save of the same
    (zero-copy) state, and the background save's remaining time."""
    model, optim = build(cfg, FLAT, seed=1)
    train_one_step(cfg, model, optim)
    sync_store, async_store = stores

    def state() -> dict:
        msd, osd = flat_state_dict(model, optim)
        return {"model": msd, "optim": osd}

    sync = measured(lambda: sync_store.save(step, state()))
    block = measured(lambda: async_store.save(step, state()))
    wait = measured(async_store.wait)
    return {"sync_save_s": sync.seconds, "async_block_s": block.seconds,
            "async_block_rss_growth": block.rss_growth, "async_wait_s": wait.seconds}


def same_model_saves(cfg: GPTConfig, root: Path, rounds: int) -> dict[str, list[dict[str, float]]]:
    """``--same-model``: per implementation, per round, the save's wall and
    CPU seconds and its ``get_state_dict`` part (see the module note)."""
    names = ("fsdp_compose", "fsdp2")
    built = {}
    for name in names:
        model, optim = build(cfg, name, seed=1)
        train_one_step(cfg, model, optim)
        built[name] = (model, optim)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % 2:] + names[:r % 2]:
            model, optim = built[name]
            path = root / f"same-{name}-{r}"
            gc.collect()
            settle_disk()
            wall, cpu = time.perf_counter(), time.process_time()
            msd, osd = get_state_dict(model, optim)
            got_wall, got_cpu = time.perf_counter(), time.process_time()
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
            dist.barrier()
            runs[name].append({"save_s": time.perf_counter() - wall,
                               "save_cpu_s": time.process_time() - cpu,
                               "get_state_dict_s": got_wall - wall,
                               "get_state_dict_cpu_s": got_cpu - cpu})
            del msd, osd
    return runs


def _same_model_main(args: argparse.Namespace, cfg: GPTConfig, root: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = same_model_saves(cfg, root, args.rounds)
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, runs)
    if rank != 0:
        return
    shutil.rmtree(root, ignore_errors=True)
    keys = ("save_s", "save_cpu_s", "get_state_dict_s", "get_state_dict_cpu_s")
    summary = {name: {key[:-2] + "_ms": statistics.median(
        run[key] for runs in per_rank for run in runs[name]) * 1e3 for key in keys}
        for name in per_rank[0]}
    base = summary["fsdp2"]
    load = os.getloadavg()[0]
    print(f"checkpoint save of the same model each round, GPT {cfg.n_layers} layers "
          f"d{cfg.d_model} vocab {cfg.vocab_size}, {world} ranks, {args.rounds} rounds "
          f"(1-minute load average at the end: {load:.1f} on {os.cpu_count()} cores)")
    columns = ["", "save", "save: CPU", "of which get_state_dict", "get_state_dict: CPU"]
    rows = [[name, f"{m['save_ms']:.0f} ms ({m['save_ms'] / base['save_ms']:.2f}x)",
             f"{m['save_cpu_ms']:.0f} ms ({m['save_cpu_ms'] / base['save_cpu_ms']:.2f}x)",
             f"{m['get_state_dict_ms']:.0f} ms", f"{m['get_state_dict_cpu_ms']:.0f} ms"]
            for name, m in summary.items()]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if args.record:
        from benchmarks.record import write_record
        suffix = "" if args.model == "default" else f"-{args.model}"
        write_record(
            "checkpoint-same-model" + suffix, order=5,
            question="Checkpoint save of one trained model, round after round "
                     f"(GPT {cfg.n_layers} x {cfg.d_model}, vocabulary {cfg.vocab_size})",
            command="torchrun --standalone --nproc-per-node 2 -m benchmarks.checkpoint "
                    + " ".join(sys.argv[1:]),
            calibration="not measured with this run; the ratios are to FSDP2 in the same rounds",
            columns=columns, rows=rows,
            notes=["Median over rounds and ranks; CPU: the process's CPU time. "
                   f"1-minute load average at the end of the run: {load:.1f} on "
                   f"{os.cpu_count()} cores."])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", choices=list(MODELS), default="default",
                   help="default: the 36M GPT (vocabulary 16,384); large-vocab: 50,304")
    p.add_argument("--layers", type=int, default=None, help="overrides the model's blocks")
    p.add_argument("--same-model", action="store_true",
                   help="build each implementation once and time its saves round after round "
                        "(get_state_dict + dcp.save to a fresh directory; no load)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--record", action="store_true",
                   help="also write the table of record, benchmarks/results/record/checkpoint.json")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = replace(MODELS[args.model], n_layers=args.layers or MODELS[args.model].n_layers)
    root = Path(tempfile.gettempdir()) / f"fsdp_compose_ckpt_bench_{os.getppid()}"
    if args.same_model:
        _same_model_main(args, cfg, root)
        dist.destroy_process_group()
        return
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in IMPLS + ("async",)}
    stores = (CheckpointStore(root / "sync", keep=1),
              CheckpointStore(root / "async", keep=1, async_save=True))
    for name in IMPLS:  # warm-up, not recorded: no implementation loads onto a cold heap
        one_round(cfg, name, root)
    for r in range(args.rounds):
        for name in IMPLS[r % len(IMPLS):] + IMPLS[:r % len(IMPLS)]:
            runs[name].append(one_round(cfg, name, root))
        runs["async"].append(async_round(cfg, root, stores, r))
    per_rank = [None] * world
    dist.all_gather_object(per_rank, runs)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        summary = summarize(per_rank)
        _print_table(summary, cfg, world)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "config": vars(cfg), "world": world, "rounds": args.rounds,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
            "torch": torch.__version__, "summary": summary, "per_rank": per_rank}, indent=1))
        if args.record:
            _record(summary, args.model, cfg)
    dist.destroy_process_group()


def summarize(per_rank: list[dict[str, list[dict[str, float]]]]) -> dict[str, dict[str, float]]:
    """Median times over ranks and rounds; memory growth: each rank's
    median over the rounds, the largest rank's (the process's RSS grows by
    what the allocator did not keep from earlier work, which varies from
    round to round by as much as the implementations differ;
    ``tests/checkpoint/test_checkpoint_load_memory.py`` counts tensor bytes instead)."""
    out = {}
    for name in IMPLS:
        samples = [run for runs in per_rank for run in runs[name]]

        def growth(key: str) -> float:
            return max(statistics.median(run[key] for run in runs[name])
                       for runs in per_rank) / 2**20
        out[name] = {
            "save_ms": statistics.median(s["save_s"] for s in samples) * 1e3,
            "save_cpu_ms": statistics.median(s["save_cpu_s"] for s in samples) * 1e3,
            "save_rss_growth_mib": growth("save_rss_growth"),
            "load_ms": statistics.median(s["load_s"] for s in samples) * 1e3,
            "load_cpu_ms": statistics.median(s["load_cpu_s"] for s in samples) * 1e3,
            "load_rss_growth_mib": growth("load_rss_growth"),
        }
    samples = [run for runs in per_rank for run in runs["async"]]
    out["async"] = {key[:-2] + "_ms": statistics.median(s[key] for s in samples) * 1e3
                    for key in ("sync_save_s", "async_block_s", "async_wait_s")}
    out["async"]["async_block_rss_growth_mib"] = max(
        s["async_block_rss_growth"] for s in samples) / 2**20
    return out


def _record(summary: dict[str, dict[str, float]], model: str, cfg: GPTConfig) -> None:
    from benchmarks.record import write_record
    base, a = summary["fsdp2"], summary["async"]
    write_record(
        "checkpoint" + ("" if model == "default" else f"-{model}"), order=5,
        question=f"Checkpoint save and load through DCP (GPT {cfg.n_layers} x {cfg.d_model}, "
                 f"vocabulary {cfg.vocab_size}, after one AdamW step)",
        command="torchrun --standalone --nproc-per-node 2 -m benchmarks.checkpoint " + " ".join(sys.argv[1:]),
        calibration="not measured with this run; the ratios are to FSDP2 in the same rounds",
        columns=["", "save", "save: CPU", "save: RSS growth", "load", "load: CPU",
                 "load: RSS growth"],
        rows=[[name, f"{m['save_ms']:.0f} ms ({m['save_ms'] / base['save_ms']:.2f}x)",
               f"{m['save_cpu_ms']:.0f} ms ({m['save_cpu_ms'] / base['save_cpu_ms']:.2f}x)",
               f"{m['save_rss_growth_mib']:.0f} MiB",
               f"{m['load_ms']:.0f} ms ({m['load_ms'] / base['load_ms']:.2f}x)",
               f"{m['load_cpu_ms']:.0f} ms ({m['load_cpu_ms'] / base['load_cpu_ms']:.2f}x)",
               f"{m['load_rss_growth_mib']:.0f} MiB"] for name, m in summary.items() if name != "async"],
        notes=["RSS growth: after a warm-up round, the median over rounds of the largest "
               "rank; it moves with what the allocator kept from earlier work. In tensor bytes "
               "the load allocates the optimizer state and nothing else, FSDP2's also its zero "
               "step's gradients and temporaries: 71,000 vs 177,920 bytes on rank 0 of "
               "`tests/checkpoint/test_checkpoint_load_memory.py` (3 ranks, uneven shapes).",
               f"Async (`CheckpointStore(async_save=True)`): a synchronous save took "
               f"{a['sync_save_ms']:.0f} ms; the async save blocked for {a['async_block_ms']:.0f} ms "
               f"and finished {a['async_wait_ms']:.0f} ms later."])


def _print_table(summary: dict[str, dict[str, float]], cfg: GPTConfig, world: int) -> None:
    print(f"checkpoint save/load, GPT {cfg.n_layers} layers d{cfg.d_model} vocab "
          f"{cfg.vocab_size}, {world} ranks, AdamW state, DCP to local disk")
    print(f"{'':18}{'save ms (/fsdp2)':>18}{'CPU ms (/fsdp2)':>18}{'+RSS':>12}"
          f"{'load ms (/fsdp2)':>17}{'CPU ms (/fsdp2)':>18}{'+RSS':>12}")
    base = summary["fsdp2"]
    for name in IMPLS:
        m = summary[name]
        print(f"{name:18}{m['save_ms']:9.0f} ({m['save_ms'] / base['save_ms']:.2f}x)"
              f"{m['save_cpu_ms']:11.0f} ({m['save_cpu_ms'] / base['save_cpu_ms']:.2f}x)"
              f"{m['save_rss_growth_mib']:8.0f} MiB"
              f"{m['load_ms']:9.0f} ({m['load_ms'] / base['load_ms']:.2f}x)"
              f"{m['load_cpu_ms']:11.0f} ({m['load_cpu_ms'] / base['load_cpu_ms']:.2f}x)"
              f"{m['load_rss_growth_mib']:8.0f} MiB")
    a = summary["async"]
    print(f"CheckpointStore (zero-copy state): synchronous save {a['sync_save_ms']:.0f} ms; "
          f"async save blocks {a['async_block_ms']:.0f} ms "
          f"({a['async_block_ms'] / a['sync_save_ms']:.0%} of it, "
          f"+{a['async_block_rss_growth_mib']:.0f} MiB staged), then finishes in the "
          f"background in {a['async_wait_ms']:.0f} ms")


if __name__ == "__main__":
    main()
