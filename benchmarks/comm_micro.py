"""Micro-benchmark: gloo's reduce-scatter against an in-place all-reduce of the
same flat buffer (keeping this rank's chunk), in fp32 and bf16.

    PYTHONPATH=. .venv/bin/python -m benchmarks.comm_micro            # 2 ranks
    PYTHONPATH=. .venv/bin/python -m benchmarks.comm_micro --sizes-mib 4 12 64 --repeats 10

Each measurement is one collective issued with ``async_op=True`` and waited,
timed on every rank after a barrier, max over ranks; variants are interleaved
(round-robin, order rotated) so that machine noise hits them alike. The
reduce-scatter variant allocates its output chunk as ``FlatGradient`` does;
the all-reduce variant reduces the flat gradient in place and copies this
rank's chunk out (what ``_comm.reduce_scatter_scaled`` does on gloo when
``reduce_scatter_via_all_reduce`` is on). Prints median ms and the ratio.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _reduce_scatter(flat: torch.Tensor, world: int, op) -> torch.Tensor:
    out = torch.empty(flat.numel() // world, dtype=flat.dtype)
    _RS(out, flat, op=op, async_op=True).wait()
    return out


def _all_reduce_chunk(flat: torch.Tensor, world: int, op) -> torch.Tensor:
    dist.all_reduce(flat, op=op, async_op=True).wait()
    chunk = flat.numel() // world
    return flat.narrow(0, dist.get_rank() * chunk, chunk).clone()


VARIANTS = {"reduce_scatter": _reduce_scatter, "all_reduce+chunk": _all_reduce_chunk}


def _worker(rank: int, world: int, port: int, sizes: list[float], repeats: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for mib in sizes:
            numel = int(mib * 2 ** 20) // 4 // world * world
            times = {name: [] for name in VARIANTS}
            names = list(VARIANTS)
            for r in range(repeats + 1):
                for name in names[r % 2:] + names[:r % 2]:
                    flat = torch.randn(numel).to(dtype)
                    dist.barrier()
                    t0 = time.perf_counter()
                    VARIANTS[name](flat, world, dist.ReduceOp.SUM)
                    dt = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                    if r:  # the first round warms up
                        times[name].append(dt.item() * 1e3)
            results[(str(dtype), mib)] = {n: statistics.median(t) for n, t in times.items()}
    if rank == 0:
        out.update(results)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[4, 12, 64],
                   help="fp32-equivalent size of the flat gradient (numel = MiB * 2**18)")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.start_processes(_worker, args=(args.nproc, port, args.sizes_mib, args.repeats, out),
                       nprocs=args.nproc, start_method="spawn")
    print(f"load average (1 min) after: {os.getloadavg()[0]:.2f}")
    print("| dtype | numel (fp32 MiB) | reduce_scatter ms | all_reduce+chunk ms | ratio RS/AR |")
    print("|---|---|---|---|---|")
    for (dtype, mib), r in sorted(out.items()):
        rs, ar = r["reduce_scatter"], r["all_reduce+chunk"]
        print(f"| {dtype} | {mib:g} | {rs:.1f} | {ar:.1f} | {rs / ar:.2f} |")


if __name__ == "__main__":
    main()
