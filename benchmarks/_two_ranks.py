"""What the small two-rank micro-benchmarks share: the GPT size arguments
and starting two spawned gloo ranks that report through a queue."""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
from multiprocessing.context import BaseContext
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_compose.testing import GPTConfig, synthetic_tokens


def gpt_arguments(description: str, repeats: int, impls: str = "",
                  flags: Optional[dict[str, str]] = None,
                  batch_per_rank: Optional[int] = None) -> argparse.Namespace:
    """``--layers --vocab --d-model --heads --repeats`` (the benchmark's default
    GPT), ``--impls`` (a comma-separated list) when ``impls`` gives its default,
    ``--batch-per-rank`` when ``batch_per_rank`` gives its default, and each
    of ``flags`` (name -> help) as an on/off option."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=repeats)
    if impls:
        parser.add_argument("--impls", default=impls)
    if batch_per_rank is not None:
        parser.add_argument("--batch-per-rank", type=int, default=batch_per_rank,
                            help="sequences of 128 tokens per rank and step")
    for name, text in (flags or {}).items():
        parser.add_argument(name, action="store_true", help=text)
    return parser.parse_args()


def run_two_ranks(worker: Callable, args: argparse.Namespace, timeout: float,
                  context: Optional[BaseContext] = None) -> Any:
    """Spawn ``worker(rank, world, init_file, args, queue)`` on 2 ranks
    (file rendezvous in a temporary directory); return what rank 0 puts on
    the queue. ``context``: the multiprocessing context that starts the ranks
    (default spawn: new interpreters; the tests pass their fork server's)."""
    world = 2
    ctx = context or mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=worker, args=(r, world, init_file, args, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        result = queue.get(timeout=timeout)
        for p in procs:
            p.join(timeout=60)
    return result


def join_gloo_group(rank: int, world: int, init_file: str, timeout_s: int) -> None:
    """One thread per rank (two ranks share the machine), then the gloo group."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    """The GPT that :func:`gpt_arguments` describes (sequence length 128)."""
    return GPTConfig(vocab_size=args.vocab, seq_len=128, d_model=args.d_model,
                     n_heads=args.heads, n_layers=args.layers)


def timed_step(model: Any, optim: torch.optim.Optimizer, cfg: GPTConfig, rank: int, world: int,
               step: int) -> float:
    """One training step on this rank's 2 rows of step ``step``'s batch, timed
    from a barrier; the slowest rank's seconds, the same on every rank."""
    x, y = synthetic_tokens(step, 2 * world, cfg.seq_len, cfg.vocab_size)
    dist.barrier()
    start = time.perf_counter()
    model.loss(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]).backward()
    optim.step()
    optim.zero_grad()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()
