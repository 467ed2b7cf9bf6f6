"""Memory of every step, phase by phase, on the CPU: fsdp_compose against
torch FSDP2 on two gloo ranks (``benchmarks/gpu/step.py`` is the
GPU's counterpart).

    PYTHONPATH=. .venv/bin/python -m benchmarks.step_memory                  # default GPT
    PYTHONPATH=. .venv/bin/python -m benchmarks.step_memory --batch-per-rank 2   # benchmarks.run's batch
    PYTHONPATH=. .venv/bin/python -m benchmarks.step_memory --layers 48 --d-model 64 --vocab 512
    # bucket caps side by side (fsdp_compose@C: buckets of at most C MiB)
    PYTHONPATH=. .venv/bin/python -m benchmarks.step_memory --layers 48 --d-model 64 --vocab 512 \
        --impls fsdp_compose@4,fsdp_compose@1,fsdp2
    # the parameters of 1 MiB or more split over every rank as FSDP2 splits them
    PYTHONPATH=. .venv/bin/python -m benchmarks.step_memory --impls fsdp_compose,fsdp_compose_shard0,fsdp2

Each implementation is built alone in the ranks, then ``--steps`` steps run
under the PyTorch profiler with ``profile_memory=True`` (every CPU tensor
allocation and free, gloo's threads included; ``benchmarks/memory.py``). Each
step is three phases (forward, backward, AdamW step + ``zero_grad``); a
table per rank shows its peak of live tensor bytes in each phase of each step,
counted from just before the model was built, and the bytes live after the
step. fp32, every block a unit plus the root; FSDP2 on a CPU mesh.

AdamW runs as torch runs it on the CPU by default (one parameter at a time:
its temporaries are the size of the largest piece of a parameter a rank
holds; on a CPU mesh the default placement gives a parameter a buffer of
its own where one buffer would put it whole on one rank, where FSDP2 holds
half of it, ``default_placement.split_whole_pieces``); ``--foreach`` runs it as on a
GPU (every parameter at once: the temporaries total the rank's shard).
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._two_ranks import gpt_arguments, gpt_config, join_gloo_group, run_two_ranks
from benchmarks.impls import build_fsdp2, build_fsdp_compose, shard_large_params
from benchmarks.memory import measure_training_memory
from fsdp_compose import flat_step
from fsdp_compose.testing import GPT, synthetic_tokens

MiB = 2 ** 20
PHASES = ("forward", "backward", "optimizer")


def _build(name: str, cfg, foreach: bool, torch_step: bool = False
           ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The seeded GPT under ``name`` (``benchmarks/impls.py``'s builders;
    fsdp_compose with the library's default placement, ``fsdp_compose@C``
    with buckets of at most ``C`` MiB, ``fsdp_compose_shard0`` with
    ``Shard(0)`` for the parameters of 1 MiB or more: split over every
    rank as FSDP2 splits them), and its AdamW."""
    torch.manual_seed(0)
    model = GPT(cfg)
    if name.startswith("fsdp_compose"):
        cap = float(name.split("@")[1]) if "@" in name else None
        placement_fn = shard_large_params if name.startswith("fsdp_compose_shard0") else None
        model = build_fsdp_compose(model, placement=None, bucket_cap_mb=cap,
                                   shard_placement_fn=placement_fn)
    else:
        model = build_fsdp2(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach or None)
    if torch_step and name.startswith("fsdp_compose"):
        flat_step(optim, enabled=False)  # torch's own step, one parameter at a time
    return model, optim


def _phase_peaks(name: str, cfg, steps: int, foreach: bool, batch: int,
                 torch_step: bool = False) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = synthetic_tokens(0, batch * world, cfg.seq_len, cfg.vocab_size)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    held: dict[str, Any] = {}

    def phase(model: torch.nn.Module, optim: torch.optim.Optimizer, i: int) -> None:
        if i % 3 == 0:
            held["loss"] = model.loss(x, y)
        elif i % 3 == 1:
            held.pop("loss").backward()
        else:
            optim.step()
            optim.zero_grad(set_to_none=True)

    def settle() -> None:
        dist.barrier()
        gc.collect()

    report = measure_training_memory(lambda: _build(name, cfg, foreach, torch_step), phase,
                                     3 * steps, settle)
    return {"peaks": [report.step_peaks[i:i + 3] for i in range(0, 3 * steps, 3)],
            "after": [report.after_step[i + 2] for i in range(0, 3 * steps, 3)]}


def _worker(rank: int, world: int, init_file: str, args, queue) -> None:
    join_gloo_group(rank, world, init_file, timeout_s=300)
    cfg = gpt_config(args)
    results = {}
    for name in args.impls:
        results[name] = _phase_peaks(name, cfg, args.repeats, args.foreach, args.batch_per_rank,
                                     args.torch_step)
        gc.collect()
    every_rank: list = [None] * world
    dist.all_gather_object(every_rank, results)
    if rank == 0:
        queue.put(every_rank)
    dist.destroy_process_group()


def main() -> None:
    args = gpt_arguments(__doc__.splitlines()[0], repeats=4,  # --repeats: the steps
                         impls="fsdp_compose,fsdp2",
                         flags={"--foreach": "AdamW(foreach=True), as on a GPU",
                                "--torch-step": "fsdp_compose's AdamW steps by torch's own "
                                                "step (flat_step(optim, enabled=False))",
                                "--record": "also write rank 0's table to "
                                            "benchmarks/results/record/memory-per-step.json"},
                         batch_per_rank=4)
    args.impls = args.impls.split(",")
    for rank, results in enumerate(run_two_ranks(_worker, args, timeout=1200)):
        print(f"GPT {args.layers} x d{args.d_model}, vocab {args.vocab}, 2 gloo ranks, batch "
              f"{args.batch_per_rank} x 128 per rank, fp32, AdamW"
              f"{'(foreach=True)' if args.foreach else ''}; rank {rank}'s live tensor MiB")
        _print_table(args, results)
        if rank == 0 and args.record:
            _record(args, results)


def _record(args, results: dict) -> None:
    from benchmarks.record import write_record
    names = list(args.impls)
    rows = []
    for step in range(args.repeats):
        for p, phase in enumerate(PHASES):
            rows.append([step + 1, f"{phase} peak"] +
                        [f"{results[n]['peaks'][step][p] / MiB:.1f}" for n in names])
        rows.append([step + 1, "after the step"] +
                    [f"{results[n]['after'][step] / MiB:.1f}" for n in names])
    write_record("memory-per-step", order=3,
                 question=(f"Memory of every step, phase by phase (GPT {args.layers} x d{args.d_model}, "
                           f"vocab {args.vocab}, batch {args.batch_per_rank} x 128 per rank, fp32, AdamW)"),
                 command="PYTHONPATH=. .venv/bin/python -m benchmarks.step_memory " + " ".join(sys.argv[1:]),
                 calibration="not a timing (memory counts do not depend on load)",
                 columns=["step", "phase"] + [f"{n} MiB" for n in names], rows=rows)


def _print_table(args, results: dict) -> None:
    theirs = results["fsdp2"]
    ours = [name for name in args.impls if name != "fsdp2"]
    print("| step | phase | " + " | ".join(ours) + " | FSDP2 | difference |")
    print("|---|---|" + "---|" * (len(ours) + 2))
    for step in range(args.repeats):
        for p, phase in enumerate(PHASES):
            values = [results[n]["peaks"][step][p] / MiB for n in ours]
            b = theirs["peaks"][step][p] / MiB
            print(f"| {step + 1} | {phase} peak | " + " | ".join(f"{a:.1f}" for a in values) +
                  f" | {b:.1f} | " + " / ".join(f"{a - b:+.1f}" for a in values) + " |")
        values = [results[n]["after"][step] / MiB for n in ours]
        b = theirs["after"][step] / MiB
        print(f"| {step + 1} | after the step | " + " | ".join(f"{a:.1f}" for a in values) +
              f" | {b:.1f} | " + " / ".join(f"{a - b:+.1f}" for a in values) + " |")


if __name__ == "__main__":
    main()
