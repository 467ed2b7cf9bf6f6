"""Save and load time and memory of a sharded checkpoint: fsdp_compose vs
torch FSDP2, in one run, both through torch.distributed.checkpoint (DCP) to
local disk.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.checkpoint            # default model
    torchrun --standalone --nproc-per-node 2 -m benchmarks.checkpoint --rounds 2 --layers 2

Each round builds each implementation afresh (interleaved, order alternating),
trains one step so AdamW has state, then times

* save: ``get_state_dict(model, optim)`` + ``dcp.save`` (the recipe in
  docs/checkpointing.md), and
* load: into a freshly built and annotated model and optimizer,
  ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``,

and the per-rank memory each adds: torch-allocated bytes are not tracked on
the CPU, so the measure is the process's resident-set high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs`` before each operation)
minus the resident set just before it. The loaded values are checked equal
to the saved ones. Rank 0 prints a table and writes
``benchmarks/results/checkpoint.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fsdp_compose.testing import GPT, GPTConfig
from benchmarks.impls import BUILDERS

IMPLS = ("fsdp_compose", "fsdp2")
RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint.json"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measured(fn: Callable[[], object]) -> tuple[float, int]:
    """(seconds, resident-set growth in bytes) of ``fn`` on this rank, after
    every rank is ready (the barrier is not timed)."""
    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current VmRSS
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    fn()
    dist.barrier()
    seconds = time.perf_counter() - start
    return seconds, (_status_kib("VmHWM") - before) * 1024


def build(cfg: GPTConfig, name: str, seed: int):
    torch.manual_seed(seed)
    model = BUILDERS[name](GPT(cfg))
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
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))

    save_s, save_bytes = measured(save)
    saved = full_values(model)
    fresh, fresh_optim = build(cfg, name, seed=2)

    def load() -> None:
        msd, osd = get_state_dict(fresh, fresh_optim)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(path))
        set_state_dict(fresh, fresh_optim, model_state_dict=msd, optim_state_dict=osd)

    load_s, load_bytes = measured(load)
    loaded = full_values(fresh)
    if any(not torch.equal(loaded[k], saved[k]) for k in saved):
        raise AssertionError(f"{name}: loaded values differ from the saved ones")
    return {"save_s": save_s, "save_rss_growth": save_bytes,
            "load_s": load_s, "load_rss_growth": load_bytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=16384, seq_len=128, d_model=512, n_heads=8, n_layers=args.layers)
    root = Path(tempfile.gettempdir()) / f"fsdp_compose_ckpt_bench_{os.getppid()}"
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in IMPLS}
    for r in range(args.rounds):
        for name in (IMPLS if r % 2 == 0 else IMPLS[::-1]):
            runs[name].append(one_round(cfg, name, root))
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
    dist.destroy_process_group()


def summarize(per_rank: list[dict[str, list[dict[str, float]]]]) -> dict[str, dict[str, float]]:
    """Median times over ranks and rounds; the largest memory growth of any rank."""
    out = {}
    for name in IMPLS:
        samples = [run for runs in per_rank for run in runs[name]]
        out[name] = {
            "save_ms": statistics.median(s["save_s"] for s in samples) * 1e3,
            "save_rss_growth_mib": max(s["save_rss_growth"] for s in samples) / 2**20,
            "load_ms": statistics.median(s["load_s"] for s in samples) * 1e3,
            "load_rss_growth_mib": max(s["load_rss_growth"] for s in samples) / 2**20,
        }
    return out


def _print_table(summary: dict[str, dict[str, float]], cfg: GPTConfig, world: int) -> None:
    print(f"checkpoint save/load, GPT {cfg.n_layers} layers d{cfg.d_model} vocab "
          f"{cfg.vocab_size}, {world} ranks, AdamW state, DCP to local disk")
    print(f"{'':14}{'save (ms)':>11}{'save +RSS':>14}{'load (ms)':>11}{'load +RSS':>14}")
    for name, m in summary.items():
        print(f"{name:14}{m['save_ms']:11.0f}{m['save_rss_growth_mib']:10.0f} MiB"
              f"{m['load_ms']:11.0f}{m['load_rss_growth_mib']:10.0f} MiB")
    mine, base = summary["fsdp_compose"], summary["fsdp2"]
    print(f"fsdp_compose / fsdp2: save {mine['save_ms'] / base['save_ms']:.2f}x time, "
          f"{mine['save_rss_growth_mib'] / max(base['save_rss_growth_mib'], 1e-9):.2f}x memory; "
          f"load {mine['load_ms'] / base['load_ms']:.2f}x time, "
          f"{mine['load_rss_growth_mib'] / max(base['load_rss_growth_mib'], 1e-9):.2f}x memory")


if __name__ == "__main__":
    main()
