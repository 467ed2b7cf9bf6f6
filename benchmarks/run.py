"""Compare fsdp_compose with torch DDP, FSDP2 and FSDP1 in one run.

    make bench                                              # = the line below
    .venv/bin/python -m benchmarks.run --scenario all       # ~10 min on 2 cores
    .venv/bin/python -m benchmarks.run --quick              # ~1 min smoke run
    .venv/bin/python -m benchmarks.run --scenario many-small --rounds 10 --steps 5
    .venv/bin/python -m benchmarks.run --scenario default --layers 12 --impls fsdp_compose,fsdp2

It starts ``--nproc`` CPU ranks itself (gloo, one torch thread each); under
``torchrun --standalone --nproc-per-node 2 -m benchmarks.run ...`` it uses the
ranks torchrun started instead. Each scenario writes a table on stdout,
``benchmarks/results/<scenario>.json`` and ``benchmarks/results/<scenario>.png``
(``--quick`` writes to ``benchmarks/results/scratch/``, which git ignores).

Scenarios (model flags such as ``--layers`` override both):

* ``default``: GPT with 6 layers, d_model 512, 8 heads, vocab 16384, seq 128;
* ``many-small``: 48 tiny blocks (d_model 64, 4 heads, vocab 512, seq 128),
  where compute is small and per-unit/per-hook CPU overhead dominates.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # `python benchmarks/run.py`: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_compose.testing import GPTConfig

from benchmarks import report
from benchmarks.impls import BUILDERS, VARIANTS
from benchmarks.worker import Settings, run_scenario

RESULTS = Path(__file__).resolve().parent / "results"

SCENARIOS: dict[str, dict] = {
    "default": dict(cfg=GPTConfig(vocab_size=16384, seq_len=128, d_model=512, n_heads=8,
                                  n_layers=6),
                    warmup=2, rounds=8, steps=2, ref_steps=4, mem_steps=3),
    "many-small": dict(cfg=GPTConfig(vocab_size=512, seq_len=128, d_model=64, n_heads=4,
                                     n_layers=48),
                       warmup=3, rounds=10, steps=4, ref_steps=4, mem_steps=3),
}
QUICK = dict(warmup=1, rounds=2, steps=1, ref_steps=2, mem_steps=2)
QUICK_MODEL = {"default": dict(n_layers=2, vocab_size=4096), "many-small": dict(n_layers=12)}
"""--quick also shrinks the models (a smoke run, not a measurement)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    p.add_argument("--quick", action="store_true",
                   help="~1 min smoke run: smaller models, 1 warm-up step, 2 rounds of 1 step, "
                        "2 reference/memory steps; writes to results/scratch/")
    p.add_argument("--impls", default=",".join(BUILDERS),
                   help=f"comma-separated subset of {','.join(BUILDERS)}, plus the A/B "
                        f"variants {','.join(VARIANTS)}")
    p.add_argument("--nproc", type=int, default=2, help="ranks to start (ignored under torchrun)")
    timing = p.add_argument_group("steps (default: per scenario)")
    timing.add_argument("--warmup", type=int, help="untimed steps per implementation")
    timing.add_argument("--rounds", type=int, help="round-robin rounds")
    timing.add_argument("--steps", type=int, help="timed steps per implementation per round")
    timing.add_argument("--ref-steps", type=int, help="steps of the single-process reference")
    timing.add_argument("--mem-steps", type=int, help="steps of the memory pass (>= 2)")
    model = p.add_argument_group("model and data (default: per scenario)")
    model.add_argument("--layers", type=int)
    model.add_argument("--d-model", type=int)
    model.add_argument("--heads", type=int)
    model.add_argument("--vocab", type=int)
    model.add_argument("--seq", type=int)
    model.add_argument("--batch-per-rank", type=int, default=2)
    model.add_argument("--lr", type=float, default=2e-4)
    model.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", action="store_true",
                   help="also write the table of record, benchmarks/results/record/cpu-step-<scenario>.json")
    p.add_argument("--out-dir", type=Path,
                   help=f"where JSON and PNG go (default {RESULTS}, or its scratch/ with --quick)")
    args = p.parse_args(argv)
    unknown = set(args.impls.split(",")) - set(BUILDERS) - set(VARIANTS)
    if unknown:
        p.error(f"unknown --impls {sorted(unknown)}; choose from {list(BUILDERS | VARIANTS)}")
    return args


def settings_for(name: str, args: argparse.Namespace) -> Settings:
    base = SCENARIOS[name] | (QUICK if args.quick else {})
    cfg = replace(base["cfg"], **(QUICK_MODEL[name] if args.quick else {}))
    overrides = {"n_layers": args.layers, "d_model": args.d_model, "n_heads": args.heads,
                 "vocab_size": args.vocab, "seq_len": args.seq}
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    picked = {k: getattr(args, k) if getattr(args, k) is not None else base[k]
              for k in ("warmup", "rounds", "steps", "ref_steps", "mem_steps")}
    if picked["mem_steps"] < 2:
        raise SystemExit("--mem-steps must be >= 2 (the first step is not steady state)")
    return Settings(scenario=name, cfg=cfg, impls=args.impls.split(","),
                    batch_per_rank=args.batch_per_rank, lr=args.lr, seed=args.seed, **picked)


def log(msg: str) -> None:
    print(msg, flush=True)


def worker(rank: int, world: int, init_method: str, all_settings: list[Settings],
           out_dir: Path, record_argv: Optional[list[str]] = None) -> None:
    """One rank: run every scenario; rank 0 writes the reports."""
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)  # FSDP1's deprecation notice
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    code = report.environment(world) if rank == 0 else {}  # the code this process imported
    try:
        for s in all_settings:
            env = report.start_clock(code)
            raw = run_scenario(s, rank, world, log)
            if rank == 0:
                report.stop_clock(env)
                summary = report.summarize(s, raw, env)
                report.write(summary, raw, out_dir, log)
                if record_argv is not None:
                    report.record(summary, record_argv)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, all_settings: list[Settings], out_dir: Path,
             record_argv: Optional[list[str]]) -> None:
    worker(rank, world, f"tcp://127.0.0.1:{port}", all_settings, out_dir, record_argv)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    record_argv = list(sys.argv[1:] if argv is None else argv) if args.record else None
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    all_settings = [settings_for(n, args) for n in names]
    out_dir = args.out_dir or (RESULTS / "scratch" if args.quick else RESULTS)
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the ranks started below
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", all_settings,
               out_dir, record_argv)
        return
    mp.start_processes(_spawned, args=(args.nproc, _free_port(), all_settings, out_dir, record_argv),
                       nprocs=args.nproc, start_method="spawn")


if __name__ == "__main__":
    main()
