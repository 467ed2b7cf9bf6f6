"""Where one training step of fsdp_compose goes: waiting on collectives,
the library's hooks (CPU work), and the rest (compute, the optimizer).

    PYTHONPATH=. .venv/bin/python -m benchmarks.step_profile                    # default GPT
    PYTHONPATH=. .venv/bin/python -m benchmarks.step_profile --layers 48 --d-model 64 \\
        --heads 4 --vocab 512 --bucket-cap-mb 0                               # many-small, no buckets

Two spawned gloo ranks (one thread each), AdamW, ``--repeats`` measured
steps after two warm-up steps; per phase, the median over steps of rank 0.
Instrumented by wrapping (timers only, no profiler): ``wait`` is the time
the main thread blocks in ``wait_watched`` (every data collective's wait);
``hooks`` is the time inside the library's forward/backward hooks and the
end-of-backward callback minus the waits inside them; ``rest`` is the step
minus both (the model's compute, autograd, the optimizer step).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks._two_ranks import gpt_arguments, gpt_config, join_gloo_group, run_two_ranks


class _Timers:
    def __init__(self) -> None:
        self.wait = 0.0
        self.hooks = 0.0
        self.depth = 0
        self.wait_in_hooks = 0.0

    def reset(self) -> None:
        self.wait = self.hooks = self.wait_in_hooks = 0.0


def _instrument(timers: _Timers) -> None:
    """Wrap the library's waits and hooks with timers (process-wide)."""
    from fsdp_compose.buffers import flat_buffer, flat_grad
    from fsdp_compose.comm import collectives
    from fsdp_compose.runtime import state, unit

    original_wait = flat_buffer.wait_watched

    def timed_wait(work, group):
        start = time.perf_counter()
        try:
            return original_wait(work, group)
        finally:
            spent = time.perf_counter() - start
            timers.wait += spent
            if timers.depth:
                timers.wait_in_hooks += spent

    for module in (flat_buffer, flat_grad, collectives):
        module.wait_watched = timed_wait

    def timed(fn):
        def call(*args, **kwargs):
            timers.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.depth -= 1
                if not timers.depth:
                    timers.hooks += time.perf_counter() - start
        return call

    cls = state.FullyShardState
    for name in ("_pre_forward", "_post_forward", "_pre_backward", "_finish_backward"):
        setattr(cls, name, timed(getattr(cls, name)))
    unit.Unit._post_backward = timed(unit.Unit._post_backward)


def _worker(rank: int, world: int, init_file: str, args, queue) -> None:
    join_gloo_group(rank, world, init_file, 300)
    timers = _Timers()
    _instrument(timers)  # before fully_shard: the hooks bind the wrapped methods
    from fsdp_compose import fully_shard, fully_shard_root
    from fsdp_compose.testing import GPT, synthetic_tokens
    cfg = gpt_config(args)
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    (fully_shard_root if args.split_root else fully_shard)(model)
    if args.bucket_cap_mb is not None:  # else the library's default
        model.set_bucket_cap_mb(args.bucket_cap_mb)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = []
    for step in range(args.repeats + 2):
        x, y = synthetic_tokens(step, 2 * world, cfg.seq_len, cfg.vocab_size, seed=0)
        x, y = x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]
        dist.barrier()
        timers.reset()
        start = time.perf_counter()
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        total = time.perf_counter() - start
        if step >= 2:
            hooks = timers.hooks - timers.wait_in_hooks
            rows.append((total, timers.wait, hooks, total - timers.wait - hooks))
    if rank == 0:
        queue.put([statistics.median(col) * 1e3 for col in zip(*rows)])
    dist.destroy_process_group()


def main() -> None:
    import argparse
    import os
    import sys
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--bucket-cap-mb", type=float, default=None)
    extra.add_argument("--split-root", action="store_true")
    known, rest = extra.parse_known_args()
    sys.argv = [sys.argv[0]] + rest
    args = gpt_arguments(__doc__.splitlines()[0], repeats=5)
    args.bucket_cap_mb, args.split_root = known.bucket_cap_mb, known.split_root
    step, wait, hooks, other = run_two_ranks(_worker, args, timeout=1200)
    cap = "default" if args.bucket_cap_mb is None else f"{args.bucket_cap_mb} MiB"
    print(f"GPT {args.layers} layers d{args.d_model} vocab {args.vocab}, 2 ranks, buckets "
          f"{cap}, split root {args.split_root}; load average (1 min) "
          f"{os.getloadavg()[0]:.2f}")
    print("| step ms | waiting on collectives | hooks (CPU) | compute, autograd, optimizer |")
    print("|---|---|---|---|")
    print(f"| {step:.1f} | {wait:.1f} ({wait / step:.0%}) | {hooks:.1f} ({hooks / step:.0%}) "
          f"| {other:.1f} ({other / step:.0%}) |")


if __name__ == "__main__":
    main()
