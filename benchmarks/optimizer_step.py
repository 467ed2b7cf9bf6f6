"""The optimizer step alone: fsdp_compose (torch's per-parameter step and
``fsdp_compose.flat_step``) against torch FSDP2 and DDP, on the default
model and on many small units, and Muon on whole-matrix shards.

    .venv/bin/python -m benchmarks.optimizer_step                    # both models, ~10 min on 2 cores
    .venv/bin/python -m benchmarks.optimizer_step --quick            # smoke run, ~1 min
    .venv/bin/python -m benchmarks.optimizer_step --scenario many-small --rounds 5
    .venv/bin/python -m benchmarks.optimizer_step --groups nanogpt   # decay / no-decay groups
    .venv/bin/python -m benchmarks.optimizer_step --muon             # Muon + AdamW: "owned" vs DDP
    .venv/bin/python -m benchmarks.optimizer_step --record           # the table of record (quiet machine)

Two spawned gloo ranks, one torch thread each. Per round and model: one
forward and backward, then each optimizer's ``step()`` timed alone (max
over ranks), the optimizers in an order that turns every round; medians
over rounds. Every optimizer has its own state over the same parameters and
gradients (the values they write do not matter here). Optimizers: AdamW
foreach and for-loop, AdamW fused where the device has a fused kernel
(the flat path leaves fused to torch: it says so, and the row shows torch's
step), SGD with momentum (torch's default foreach choice). ``--muon``: torch's
Muon on the blocks' matrices with AdamW on the rest, placement ``"owned"``
(each matrix whole on one rank) against DDP (every rank orthogonalises every
matrix), and AdamW alone on the default shards.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp_compose.testing import GPT, GPTConfig, synthetic_tokens

from benchmarks._two_ranks import join_gloo_group, run_two_ranks

SCENARIOS = {
    "default": GPTConfig(vocab_size=16384, seq_len=128, d_model=512, n_heads=8, n_layers=6),
    "many-small": GPTConfig(vocab_size=512, seq_len=128, d_model=64, n_heads=4, n_layers=48),
}
QUICK = {"default": dict(n_layers=2, vocab_size=4096), "many-small": dict(n_layers=12)}
IMPLS = ("ddp", "fsdp2", "fsdp_compose", "fsdp_compose flat")
ROWS_PER_RANK = 2
LR = 2e-4


def _optimizers(device: torch.device) -> dict[str, dict]:
    """Name -> (class, keyword arguments); fused only where the device has it."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices
    out = {"AdamW foreach": dict(cls=torch.optim.AdamW, foreach=True),
           "AdamW for-loop": dict(cls=torch.optim.AdamW, foreach=False)}
    if device.type in _get_fused_kernels_supported_devices():
        out["AdamW fused"] = dict(cls=torch.optim.AdamW, fused=True)
    out["SGD momentum"] = dict(cls=torch.optim.SGD, momentum=0.9)
    return out


def _model(cfg: GPTConfig, impl: str):
    torch.manual_seed(0)
    model = GPT(cfg)
    if impl == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if impl == "fsdp2":
        from benchmarks.impls import build_fsdp2
        return build_fsdp2(model)
    from fsdp_compose import fully_shard
    owned = impl.endswith("owned")
    for block in model.blocks:
        fully_shard(block, shard_placement_fn=(lambda p: "owned" if p.ndim == 2 else None)
                    if owned else None)
    fully_shard(model)
    model.set_check_rank_divergence(False)  # time the steady state
    return model


def _groups(params, nanogpt: bool) -> list:
    """One group, or nanoGPT's two: weight decay 0.1 on the parameters of
    two or more dimensions (the original shape's), none on the rest."""
    params = list(params)
    if not nanogpt:
        return params
    from fsdp_compose import param_info

    def dims(p) -> int:
        info = param_info(p)
        return len(info.shape) if info is not None else p.dim()  # DDP's, FSDP2's: whole shapes
    return [{"params": [p for p in params if dims(p) >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if dims(p) < 2], "weight_decay": 0.0}]


def _make(spec: dict, params, flat: bool, nanogpt: bool = False) -> torch.optim.Optimizer:
    """``flat``: the flat step from the first step; otherwise torch's own
    step (the flat step, fsdp_compose's default, turned off)."""
    from fsdp_compose import flat_step
    kwargs = {k: v for k, v in spec.items() if k != "cls"}
    optim = spec["cls"](_groups(params, nanogpt), lr=LR, **kwargs)
    flat_step(optim, enabled=flat)
    return optim


def _muon_optimizers(model, ddp: bool) -> list[torch.optim.Optimizer]:
    blocks = model.module.blocks if ddp else model.blocks
    matrices = [p for p in blocks.parameters() if p.ndim == 2]
    taken = {id(p) for p in matrices}
    return [torch.optim.AdamW([p for p in model.parameters() if id(p) not in taken], lr=LR),
            torch.optim.Muon(matrices, lr=0.02, adjust_lr_fn="match_rms_adamw")]


def _timed(fn) -> float:
    """Seconds ``fn`` took, max over ranks."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def _backward(model, cfg: GPTConfig, step: int, rank: int, world: int) -> None:
    model.zero_grad(set_to_none=True)
    x, y = synthetic_tokens(step, ROWS_PER_RANK * world, cfg.seq_len, cfg.vocab_size)
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    logits = model(x[rows])
    F.cross_entropy(logits.flatten(0, 1), y[rows].flatten()).backward()


def _setups(cfg: GPTConfig, muon: bool, nanogpt: bool = False
            ) -> list[tuple[str, object, dict[str, list]]]:
    """(model name, model, {row name: optimizers stepped together})."""
    specs = _optimizers(torch.device("cpu"))
    if muon:
        setups = []
        for impl in ("ddp", "fsdp_compose owned", "fsdp_compose"):
            model = _model(cfg, impl)
            rows = {f"{impl}, Muon + AdamW": _muon_optimizers(model, impl == "ddp")} \
                if impl != "fsdp_compose" else \
                {"fsdp_compose, AdamW": [torch.optim.AdamW(model.parameters(), lr=LR)],
                 "fsdp_compose flat, AdamW": [_make(specs["AdamW foreach"], model.parameters(),
                                                    True)]}
            setups.append((impl, model, rows))
        return setups
    setups = []
    for impl in IMPLS[:3]:
        model = _model(cfg, impl)
        rows = {}
        for name, spec in specs.items():
            rows[(impl, name)] = [_make(spec, model.parameters(), False, nanogpt)]
            if impl == "fsdp_compose":
                rows[("fsdp_compose flat", name)] = [_make(spec, model.parameters(), True,
                                                           nanogpt)]
        setups.append((impl, model, rows))
    return setups


def _worker(rank: int, world: int, init_file: str, args: argparse.Namespace, queue) -> None:
    join_gloo_group(rank, world, init_file, timeout_s=1800)
    warnings.filterwarnings("ignore", message="fsdp_compose.flat_step")  # fused: in the notes
    results = {}
    for scenario in args.scenarios:
        cfg = SCENARIOS[scenario]
        if args.quick:
            cfg = GPTConfig(**{**cfg.__dict__, **QUICK[scenario]})
        setups = _setups(cfg, args.muon, args.groups == "nanogpt")
        optim_ms: dict = {row: [] for _, _, rows in setups for row in rows}
        backward_ms: dict = {impl: [] for impl, _, _ in setups}
        for round_ in range(args.warmup + args.rounds):
            for impl, model, rows in setups:
                took = _timed(lambda: _backward(model, cfg, round_, rank, world))
                names = list(rows)
                turn = round_ % len(names)
                for row in names[turn:] + names[:turn]:  # another order each round
                    step = _timed(lambda: [o.step() for o in rows[row]])
                    if round_ >= args.warmup:
                        optim_ms[row].append(step * 1e3)
                if round_ >= args.warmup:
                    backward_ms[impl].append(took * 1e3)
        results[scenario] = {
            "optim_ms": {row: statistics.median(v) for row, v in optim_ms.items()},
            "forward_backward_ms": {k: statistics.median(v) for k, v in backward_ms.items()},
            "params": sum(1 for _ in setups[0][1].parameters())}
        del setups
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def _table(scenario: str, result: dict) -> tuple[list[str], list[list[str]]]:
    """Columns and rows: per optimizer, each implementation's ms and the
    flat path's ratios to DDP and FSDP2."""
    optim = result["optim_ms"]
    columns = ["optimizer", *IMPLS, "flat / DDP", "flat / FSDP2"]
    rows = []
    for name in dict.fromkeys(name for _, name in optim):
        ms = {impl: optim.get((impl, name)) for impl in IMPLS}
        flat, ddp, fsdp2 = ms["fsdp_compose flat"], ms["ddp"], ms["fsdp2"]
        rows.append([f"{scenario}: {name}", *(f"{ms[i]:.1f} ms" for i in IMPLS),
                     f"{flat / ddp:.2f}x", f"{flat / fsdp2:.2f}x"])
    return columns, rows


def _whole_step_note(scenario: str, result: dict) -> str:
    fb, optim = result["forward_backward_ms"], result["optim_ms"]
    per_param = fb["fsdp_compose"] + optim[("fsdp_compose", "AdamW foreach")]
    flat = fb["fsdp_compose"] + optim[("fsdp_compose flat", "AdamW foreach")]
    ddp = fb["ddp"] + optim[("ddp", "AdamW foreach")]
    return (f"{scenario}: forward+backward then AdamW foreach: fsdp_compose {per_param:.0f} ms, "
            f"with flat_step {flat:.0f} ms ({flat / ddp:.2f}x DDP's {ddp:.0f} ms).")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="smaller models, 2 rounds (a smoke run)")
    p.add_argument("--groups", choices=["one", "nanogpt"], default="one",
                   help="one param group, or nanoGPT's two (weight decay 0.1 on the parameters "
                        "of >= 2 dimensions, none on the rest); every implementation alike")
    p.add_argument("--muon", action="store_true",
                   help="Muon + AdamW with placement 'owned' vs DDP (default model)")
    p.add_argument("--record", action="store_true",
                   help="write benchmarks/results/record/optimizer-step.json (a quiet machine)")
    args = p.parse_args()
    args.scenarios = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    if args.muon:
        args.scenarios = ["default"] if args.scenario == "all" else args.scenarios
    if args.quick:
        args.rounds, args.warmup = 2, 1
    return args


def main() -> None:
    args = parse_args()
    results = run_two_ranks(_worker, args, timeout=3600)
    print(f"optimizer step alone, 2 gloo ranks, {args.rounds} interleaved rounds "
          f"(medians, max over ranks), param groups: {args.groups}")
    if args.muon:
        for scenario, result in results.items():
            print(f"| {scenario} | optimizer step ms | forward+backward ms |")
            print("|---|---|---|")
            for row, ms in result["optim_ms"].items():
                impl = row.split(",")[0].replace(" flat", "")
                print(f"| {row} | {ms:.1f} | {result['forward_backward_ms'][impl]:.0f} |")
        return
    every_row, notes = [], []
    for scenario, result in results.items():
        columns, rows = _table(scenario, result)
        every_row += rows
        notes.append(_whole_step_note(scenario, result))
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in every_row:
        print("| " + " | ".join(row) + " |")
    for note in notes:
        print(note)
    if args.record:
        _record(args, results, columns, every_row, notes)


def _record(args, results, columns, rows, notes) -> None:
    from benchmarks.record import write_record
    ddp = [r["optim_ms"][("ddp", "AdamW foreach")] for r in results.values()]
    write_record(
        "optimizer-step" + ("-nanogpt-groups" if args.groups == "nanogpt" else ""), order=8,
        question="The optimizer step alone: torch's per-parameter step and flat_step vs FSDP2 "
                 "and DDP" + (", nanoGPT's weight-decay groups" if args.groups == "nanogpt"
                              else ""),
        command="python -m benchmarks.optimizer_step " + " ".join(sys.argv[1:]),
        calibration="DDP's AdamW foreach step in the same rounds: " + ", ".join(
            f"{s} {ms:.1f} ms" for s, ms in zip(results, ddp)),
        columns=columns, rows=rows,
        notes=[*notes, "AdamW fused: fsdp_compose flat leaves fused groups to torch's own step "
                       "(the row repeats torch's per-parameter fused step).",
               f"Param groups: {args.groups}. Machine load at the end of the run: 1-minute "
               f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores."])


if __name__ == "__main__":
    main()
