"""Train a small GPT-style model with fsdp_compose on CPU ranks.

    # two CPU ranks on this machine (what `make demo` runs)
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py
    # one node with GPUs: NCCL is picked automatically when CUDA is available
    torchrun --standalone --nproc-per-node 8 examples/train_gpt.py --layers 12 --width 768
    # two nodes
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-endpoint HOST:29500 examples/train_gpt.py
    # checkpoint every 5 steps; rerun the same command (or let torchrun restart
    # it, --max-restarts) to continue from the newest checkpoint, bit for bit
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
        examples/train_gpt.py --ckpt-dir ckpt --save-every 5 --resume

Every block is its own unit, then the root; the optimizer is a plain AdamW
with decay/no-decay groups built from the parameters' original shapes, its
learning rate follows a linear warmup then cosine decay (LambdaLR).
Losses printed by rank 0 (`step N loss X`, N counted from 1, X the exact
float) are the mean over all ranks.

Checkpoints (`--ckpt-dir`) are saved with `fsdp_compose.checkpoint.CheckpointStore`
(torch.distributed.checkpoint underneath) and hold the model and optimizer
(`get_state_dict`), the LR scheduler and the number of steps done. The data of
step N is a pure function of N and the rank (`synthetic_tokens`), so the step
number is the data position and a resumed run at the same world size repeats
an uninterrupted one exactly. `--fail-at-step K` is a testing aid: rank 1
exits abruptly at the start of step K, on torchrun's first attempt only
(TORCHELASTIC_RESTART_COUNT 0), to exercise restart and resume.
A failing rank ends the attempt (torchrun stops the others); collectives
time out after 5 minutes (`init_from_torchrun`) if a rank hangs instead.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_compose import fully_shard, param_info
from fsdp_compose.checkpoint import CheckpointStore
from fsdp_compose.testing import GPT, GPTConfig, init_from_torchrun, synthetic_tokens


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=0,
                        help="linear LR warmup steps before the cosine decay (default 0)")
    parser.add_argument("--min-lr-ratio", type=float, default=1.0,
                        help="final LR / --lr of the cosine decay (default 1.0: constant LR)")
    parser.add_argument("--decay-steps", type=int, default=None,
                        help="length of the schedule (default --steps; give it explicitly when a "
                             "run is split into invocations with growing --steps)")
    parser.add_argument("--ckpt-dir", default=None,
                        help="save checkpoints here (default: no checkpointing)")
    parser.add_argument("--save-every", type=int, default=0,
                        help="save every N steps (and after the last one); needs --ckpt-dir")
    parser.add_argument("--keep", type=int, default=2, help="checkpoints to keep (default 2)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in --ckpt-dir if there is one")
    parser.add_argument("--fail-at-step", type=int, default=None, metavar="K",
                        help="testing aid: rank 1 exits abruptly (os._exit(1)) at the start of "
                             "step K on torchrun's first attempt only")
    args = parser.parse_args()
    if (args.save_every or args.resume) and not args.ckpt_dir:
        parser.error("--save-every and --resume need --ckpt-dir")
    return args


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warmup over ``warmup`` steps, then cosine from 1 to ``min_ratio``."""
    def factor(done: int) -> float:
        if done < warmup:
            return (done + 1) / warmup
        progress = min(1.0, (done - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


class TrainState(Stateful):
    """Everything a resumed run needs, as one DCP ``Stateful``: the model and
    optimizer in torch FSDP2's layout, the scheduler, and the steps done
    (which is also the data position: step N trains on ``synthetic_tokens(N - 1)``)."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer,
                 sched: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.model, self.optim, self.sched = model, optim, sched
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd, "sched": self.sched.state_dict(), "step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
        self.sched.load_state_dict(sd["sched"])
        self.step = int(sd["step"])


def main() -> None:
    args = parse_args()
    device = init_from_torchrun()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.width,
                    n_heads=args.heads, n_layers=args.layers)
    torch.manual_seed(0)  # every rank builds the same initial model
    model = GPT(cfg).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

    decay = [p for p in model.parameters() if len(param_info(p).shape) >= 2]
    no_decay = [p for p in model.parameters() if len(param_info(p).shape) < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                               {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lr_lambda(args.warmup, args.decay_steps or args.steps, args.min_lr_ratio))
    state = TrainState(model, optim, sched)
    store = CheckpointStore(args.ckpt_dir, keep=args.keep) if args.ckpt_dir else None
    if rank == 0:
        total = sum(param_info(p).numel for p in model.parameters())
        local = sum(p.numel() for p in model.parameters())
        print(f"{world} ranks on {device}: {total / 1e6:.2f}M parameters, "
              f"{local / 1e6:.2f}M on this rank")
    if store is not None and args.resume:
        resumed = store.load_latest({"train": state})
        if rank == 0:
            print(f"resumed from {store.path(resumed)} after step {state.step}" if resumed is not None
                  else f"no checkpoint in {args.ckpt_dir}: starting from scratch", flush=True)

    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    per = args.batch_per_rank
    for step in range(state.step + 1, args.steps + 1):
        if step == args.fail_at_step and rank == 1 and first_attempt:
            print(f"rank 1: --fail-at-step {step}: exiting", flush=True)
            os._exit(1)
        x, y = synthetic_tokens(step - 1, per * world, cfg.seq_len, cfg.vocab_size)
        x, y = x[rank * per:(rank + 1) * per].to(device), y[rank * per:(rank + 1) * per].to(device)
        loss = model.loss(x, y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        sched.step()
        state.step = step
        dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step} loss {loss.item()!r}", flush=True)
        if store is not None and (step == args.steps or (args.save_every and step % args.save_every == 0)):
            path = store.save(step, {"train": state})
            if rank == 0:
                print(f"saved {path}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Skip interpreter teardown: a process group still referenced then (the
    # model is kept alive by torch's state-dict helpers' cache and by
    # autograd hooks) is destroyed during finalisation, and gloo aborts a few
    # percent of such exits ("terminate called without an active exception")
    # after all the work is done, failing the job. Everything is flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
