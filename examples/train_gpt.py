"""Train a small GPT-style model with fsdp_compose under torchrun.

    # two CPU ranks on this machine (what `make demo` runs)
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py
    # bf16 compute, activation checkpointing, 4 micro-batches of 8 rows per step
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py \\
        --mixed-precision bf16 --activation-checkpointing --batch-per-rank 8 --micro-batches 4
    # the same steps with torch DDP and torch FSDP2 afterwards, side by side
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --compare
    # one node with GPUs: NCCL is picked automatically when CUDA is available
    torchrun --standalone --nproc-per-node 8 examples/train_gpt.py --layers 12 --width 768
    # two nodes, hybrid sharding: sharded within a node, replicated across nodes
    # (run on every node; HOST is node 0's address)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        --rdzv-id job1 examples/train_gpt.py --hsdp
    # checkpoint every 5 steps; rerun the same command (or let torchrun restart
    # it, --max-restarts) to continue from the newest checkpoint, bit for bit
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
        examples/train_gpt.py --ckpt-dir ckpt --save-every 5 --resume

Every block is its own unit, then the root (each with the same
`MixedPrecisionPolicy` under `--mixed-precision bf16`; with
`--activation-checkpointing` each block is wrapped by torch's composable
`checkpoint` first, which keeps parameter names). The optimizer is a plain
AdamW with decay/no-decay groups built from the parameters' original shapes;
its learning rate follows a linear warmup then cosine decay (LambdaLR).

One optimizer step takes `--micro-batches` forward/backward passes of
`--batch-per-rank` rows on every rank; gradients are synchronised only on the
last one (`set_requires_gradient_sync(False)` before the others) and each
micro-batch's loss is divided by the number of micro-batches, so
`--batch-per-rank 2 --micro-batches 2` trains exactly like `--batch-per-rank 4`.
The data of step N is a pure function of N, `--seed` and the global batch
(`synthetic_tokens`), so the step number is the data position.

Output (rank 0 unless `--log-all-ranks`): progress on stderr with the loss,
tokens/s and every rank's resident memory (one all_gather of a few numbers per
step, which also averages the loss): a tqdm bar on a terminal, one line every
tenth of the steps when stderr is a file or a pipe (examples/_progress.py);
`step N loss X` lines on stdout (N counted from 1, X the exact float mean over
all ranks; every `--log-every` steps); a summary at the end (after `--resume`
it counts the steps run now and names the step reached); in `--out-dir`,
`summary.json` and, when matplotlib is installed (`pip install -e '.[bench]'`),
`train_gpt.png` with the loss and memory curves. `--compare` then trains the
same steps with torch DDP and torch FSDP2 (same seed, data, optimizer and
options; DDP has no mixed precision and stays in fp32) and adds them to the
table: final loss, mean step time (the first step, a warm-up, excluded),
tokens/s and each rank's peak memory (process RSS high-water mark, reset
before each run; on CUDA also the peak allocated device memory); the largest
loss difference from fsdp_compose is printed and plotted (in fp32 the three
usually agree exactly, so their loss curves coincide).

Checkpoints (`--ckpt-dir`) are saved with `fsdp_compose.checkpoint.CheckpointStore`
(torch.distributed.checkpoint underneath) and hold the model and optimizer
(`get_state_dict`), the LR scheduler and the number of steps done, so a
resumed run at the same world size repeats an uninterrupted one exactly.
`--fail-at-step K` is a testing aid: rank 1 exits abruptly (or raises, with
`--fail-mode raise`) at the start of step K, on torchrun's first attempt only
(TORCHELASTIC_RESTART_COUNT 0), to exercise restart and resume.

Failures: an exception on a rank is printed with the rank (and recorded for
torchrun's failure summary) and the rank exits with status 1, upon which
torchrun stops the others; Ctrl-C prints a message and exits with status 130.
Collectives time out after 5 minutes (`init_from_torchrun`) if a rank hangs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_compose import MixedPrecisionPolicy, fully_shard, param_info
from fsdp_compose.checkpoint import CheckpointStore
from fsdp_compose.testing import GPT, GPTConfig, init_from_torchrun, synthetic_tokens

# the example's own modules, next to this file
from _memory import cuda_mib, per_rank, reset_peak_memory, rss_mib
from _optimizers import Optimizers, Schedulers, _owned_matrices, build_optimizer, flat_summary
from _progress import Progress, say
from _report import RunStats, plural, report, summary_header

IMPLS = ("fsdp_compose", "ddp", "fsdp2")


class _Help(argparse.HelpFormatter):
    """Shows "(default: X)" unless the help text already says it or X is None/False."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = not any(action.default is v for v in (None, False, argparse.SUPPRESS))
        if shown and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _reshard_choice(value: str) -> str:
    if value in ("default", "true", "false") or value.isdigit():
        return value
    raise argparse.ArgumentTypeError(f"expected default, true, false or an int, got {value!r}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=_Help)
    model = parser.add_argument_group("model")
    model.add_argument("--layers", type=int, default=4, help="transformer blocks")
    model.add_argument("--width", type=int, default=128, help="model dimension")
    model.add_argument("--heads", type=int, default=4, help="attention heads")
    model.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    model.add_argument("--seq", type=int, default=64, help="sequence length")

    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=20, help="optimizer steps")
    train.add_argument("--batch-per-rank", type=int, default=4,
                       help="rows per micro-batch on each rank")
    train.add_argument("--micro-batches", type=int, default=1,
                       help="gradient accumulation: micro-batches per optimizer step")
    train.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    train.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                       help="muon: torch.optim.Muon on the blocks' weight matrices (each whole "
                            "on one rank: placement 'owned'), AdamW on the rest")
    train.add_argument("--muon-lr", type=float, default=0.02, help="peak learning rate (Muon)")
    train.add_argument("--warmup", type=int, default=0,
                       help="linear LR warmup steps before the cosine decay")
    train.add_argument("--min-lr-ratio", type=float, default=1.0,
                       help="final LR / --lr of the cosine decay (1.0: constant LR)")
    train.add_argument("--decay-steps", type=int, default=None,
                       help="length of the schedule (default --steps; give it explicitly when a "
                            "run is split into invocations with growing --steps)")
    train.add_argument("--seed", type=int, default=0, help="model initialisation and data")
    train.add_argument("--mixed-precision", choices=("none", "bf16"), default="none",
                       help="bf16: bf16 parameters and compute, fp32 gradient reduction "
                            "(sharded parameters and optimizer stay fp32)")
    train.add_argument("--reshard-after-forward", type=_reshard_choice, default="default",
                       help="default (the default): every unit but the root; false: none "
                            "(no all-gather in backward); true: all; an int k dividing the "
                            "shard group size: keep the blocks sharded over k ranks between "
                            "forward and backward")
    train.add_argument("--hsdp", action="store_true",
                       help="hybrid sharding on a (nodes, ranks per node) mesh: shard within "
                            "a node, replicate across nodes (LOCAL_WORLD_SIZE ranks per node)")
    train.add_argument("--activation-checkpointing", action="store_true",
                       help="recompute each block's activations in backward")

    out = parser.add_argument_group("output")
    out.add_argument("--out-dir", default=None,
                     help="summary.json and the plot go here (default runs/train_gpt-<time>)")
    out.add_argument("--log-every", type=int, default=1,
                     help="print `step N loss X` every N steps (and the last)")
    out.add_argument("--log-all-ranks", action="store_true",
                     help="every rank prints its own loss and memory each logged step")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument("--compare", action="store_true",
                     help="afterwards run the same steps with torch DDP and FSDP2 and compare")

    ckpt = parser.add_argument_group("checkpointing")
    ckpt.add_argument("--ckpt-dir", default=None,
                      help="save checkpoints here (default: none)")
    ckpt.add_argument("--save-every", type=int, default=0,
                      help="save every N steps (and after the last one); needs --ckpt-dir")
    ckpt.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    ckpt.add_argument("--async-save", action="store_true",
                      help="save in the background: training waits only for the copy to "
                           "host memory; a checkpoint counts once every rank committed it")
    ckpt.add_argument("--resume", action="store_true",
                      help="continue from the newest checkpoint in --ckpt-dir if there is one")
    ckpt.add_argument("--fail-at-step", type=int, default=None, metavar="K",
                      help="testing aid: rank 1 fails at the start of step K on torchrun's "
                           "first attempt only")
    ckpt.add_argument("--fail-mode", choices=("exit", "raise"), default="exit",
                      help="how --fail-at-step fails: os._exit(1) (a crash) or an exception")
    args = parser.parse_args()
    if (args.save_every or args.resume or args.async_save) and not args.ckpt_dir:
        parser.error("--save-every, --resume and --async-save need --ckpt-dir")
    if args.width % args.heads:
        parser.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    for name in ("steps", "batch_per_rank", "micro_batches", "log_every", "layers", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


# ---------------------------------------------------------------- model and optimizer
def model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.width,
                     n_heads=args.heads, n_layers=args.layers)


def build_model(args: argparse.Namespace, impl: str, device: torch.device) -> nn.Module:
    """The seeded GPT (the same initial values on every rank), activation
    checkpointing per block if asked (before sharding), then ``impl``'s data
    parallelism: fully_shard every block and the root (fsdp_compose, torch
    FSDP2, with the same options), or torch DDP."""
    torch.manual_seed(args.seed)
    model = GPT(model_config(args)).to(device)
    if args.activation_checkpointing:
        from torch.distributed._composable import checkpoint
        for block in model.blocks:
            checkpoint(block)
    reshard = {"default": None, "true": True, "false": False}.get(args.reshard_after_forward)
    if reshard is None and args.reshard_after_forward.isdigit():
        reshard = int(args.reshard_after_forward)
    bf16 = args.mixed_precision == "bf16"
    if impl == "fsdp_compose":
        kwargs: dict[str, Any] = {"reshard_after_forward": reshard, "mesh": data_mesh(args, device)}
        if bf16:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                       reduce_dtype=torch.float32)
        for block in model.blocks:
            # Muon needs whole matrices: each lives on one rank, the others hold 0 rows
            fully_shard(block, **kwargs, shard_placement_fn=(
                _owned_matrices if args.optimizer == "muon" else None))
        fully_shard(model, **kwargs)
        return model
    if impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        kwargs = {"mesh": data_mesh(args, device), "reshard_after_forward": reshard}
        if bf16:
            kwargs["mp_policy"] = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            torch_fully_shard(block, **kwargs)
        torch_fully_shard(model, **kwargs)
        return model
    if impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        ids = [torch.cuda.current_device()] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    raise ValueError(impl)


def data_mesh(args: argparse.Namespace, device: torch.device) -> DeviceMesh:
    """The data-parallel mesh: 1-D over every rank, or with ``--hsdp`` 2-D
    ``(replicate, shard)`` = (nodes, ranks per node)."""
    world = dist.get_world_size()
    if not args.hsdp:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return init_device_mesh(device.type, (world // per_node, per_node),
                            mesh_dim_names=("replicate", "shard"))


class TrainState(Stateful):
    """Everything a resumed run needs, as one DCP ``Stateful``: the model and
    optimizer in torch FSDP2's layout, the scheduler, and the steps done
    (which is also the data position: step N trains on ``synthetic_tokens(N - 1)``)."""

    def __init__(self, model: nn.Module, optim: Optimizers, sched: Schedulers) -> None:
        self.model, self.optim, self.sched = model, optim, sched
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optim.optimizers)
        return {"model": msd, "optim": osd, "sched": self.sched.state_dict(), "step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optim.optimizers, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
        self.sched.load_state_dict(sd["sched"])
        self.step = int(sd["step"])



def train(args: argparse.Namespace, impl: str, model: nn.Module, optim: Optimizers,
          sched: Schedulers, device: torch.device, first_step: int,
          after_step: Optional[Callable[[int], None]] = None, main_run: bool = True) -> RunStats:
    """Steps ``first_step..args.steps``. Every step: ``--micro-batches``
    forward/backward passes (gradient sync on the last only), the optimizer
    and scheduler steps, then one all_gather of (loss, memory) per rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model_config(args)
    per, micro = args.batch_per_rank, args.micro_batches
    stats = RunStats(impl, tokens_per_step=per * micro * world * cfg.seq_len)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    progress = None
    if rank == 0 and not args.no_progress and first_step <= args.steps:
        progress = Progress(args.steps, initial=first_step - 1, desc=impl, file=sys.stderr)
    gathered = [torch.zeros(5, dtype=torch.float64, device=device) for _ in range(world)]
    try:
        for step in range(first_step, args.steps + 1):
            _where.update(impl=impl, step=step)
            if main_run and step == args.fail_at_step and rank == 1 and first_attempt:
                print(f"rank 1: --fail-at-step {step}: exiting", flush=True)
                if args.fail_mode == "exit":
                    os._exit(1)
                raise RuntimeError(f"--fail-at-step {step}: simulated failure on rank 1")
            start = time.perf_counter()
            x, y = synthetic_tokens(step - 1, per * micro * world, cfg.seq_len, cfg.vocab_size,
                                    seed=args.seed)
            rows = slice(rank * per * micro, (rank + 1) * per * micro)
            x, y = x[rows].to(device), y[rows].to(device)
            total = torch.zeros((), device=device)
            for i in range(micro):
                last = i == micro - 1
                sync = contextlib.nullcontext()
                if micro > 1:
                    if impl == "ddp":
                        sync = contextlib.nullcontext() if last else model.no_sync()
                    else:
                        model.set_requires_gradient_sync(last)
                with sync:
                    logits = model(x[i * per:(i + 1) * per])
                    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                           y[i * per:(i + 1) * per].reshape(-1))
                    if micro > 1:
                        loss = loss / micro  # the mean over the whole step's rows
                    loss.backward()
                total += loss.detach()
            optim.step()
            optim.zero_grad()
            sched.step()
            cur_cuda, peak_cuda = cuda_mib(device)
            mine = torch.tensor([total.item(), *rss_mib(), cur_cuda, peak_cuda],
                                dtype=torch.float64, device=device)
            dist.all_gather(gathered, mine)
            rows_all = torch.stack(gathered).tolist()  # world x 5
            seconds = time.perf_counter() - start
            mean_loss = float(torch.tensor([r[0] for r in rows_all], dtype=torch.float32).mean())
            stats.steps.append(step)
            stats.losses.append(mean_loss)
            stats.step_seconds.append(seconds)
            stats.rss.append([r[1] for r in rows_all])
            stats.peak_rss = [r[2] for r in rows_all]
            if device.type == "cuda":
                stats.cuda.append([r[3] for r in rows_all])
                stats.peak_cuda = [r[4] for r in rows_all]
            logged = step % args.log_every == 0 or step == args.steps
            if main_run and logged:
                if rank == 0:
                    say(f"step {step} loss {mean_loss!r}")
                if args.log_all_ranks:
                    mem = f"rss {rows_all[rank][1]:.0f} MiB"
                    if device.type == "cuda":
                        mem += f", cuda {cur_cuda:.0f} MiB"
                    say(f"[rank {rank}] step {step} local loss {rows_all[rank][0]:.6f} "
                        f"{mem} {seconds * 1000:.1f} ms")
            if progress is not None:
                mem = [r[3] for r in rows_all] if device.type == "cuda" else [r[1] for r in rows_all]
                recent = stats.step_seconds[-10:]  # tokens/s over the last 10 steps
                progress.step(f"loss {mean_loss:.4f}, "
                              f"{stats.tokens_per_step * len(recent) / sum(recent):,.0f} tok/s, "
                              f"{'cuda' if device.type == 'cuda' else 'rss'} {per_rank(mem)}")
            if after_step is not None:
                after_step(step)
    finally:
        if progress is not None:
            progress.close()
    _where.update(impl=None, step=None)
    return stats


# ---------------------------------------------------------------- main
def run(args: argparse.Namespace, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    started = time.perf_counter()
    reset_peak_memory(device)
    model = build_model(args, "fsdp_compose", device)
    optim, sched = build_optimizer(args, model)
    state = TrainState(model, optim, sched)
    store = CheckpointStore(args.ckpt_dir, keep=args.keep, async_save=args.async_save) \
        if args.ckpt_dir else None
    total = sum(param_info(p).numel for p in model.parameters())
    local = sum(p.numel() for p in model.parameters())
    options = [args.mixed_precision if args.mixed_precision != "none" else "fp32",
               f"reshard_after_forward={args.reshard_after_forward}"]
    if args.optimizer == "muon":
        options.append("Muon on the block matrices (placement 'owned') + AdamW")
    if args.activation_checkpointing:
        options.append("activation checkpointing")
    if args.hsdp:
        mesh = data_mesh(args, device)
        options.append(f"HSDP {mesh.size(0)} replicas x {mesh.size(1)} shards")
    if rank == 0:
        print(f"{plural(world, 'rank')} on {device}: {total / 1e6:.2f}M parameters, "
              f"{local / 1e6:.2f}M on this rank", flush=True)
    if args.log_all_ranks:
        say(f"[rank {rank}] {local / 1e6:.2f}M parameters on this rank, "
            f"rss {rss_mib()[0]:.0f} MiB")
    if store is not None and args.resume:
        resumed = store.load_latest({"train": state})
        if rank == 0:
            print(f"resumed from {store.path(resumed)} after step {state.step}" if resumed is not None
                  else f"no checkpoint in {args.ckpt_dir}: starting from scratch", flush=True)

    def after_step(step: int) -> None:
        state.step = step
        if store is not None and (step == args.steps or (args.save_every and step % args.save_every == 0)):
            path = store.save(step, {"train": state})
            if rank == 0:
                say(f"saving {path} in the background" if args.async_save else f"saved {path}")

    first_step = state.step + 1  # after a resume, the step after the checkpoint's
    header = summary_header(args, world, f"{device.type} ({dist.get_backend()})", total, options,
                            first_step)
    runs = [train(args, "fsdp_compose", model, optim, sched, device, first_step, after_step)]
    if runs[0].losses:
        header += f", {flat_summary(optim)}"
    if store is not None and args.async_save:
        store.wait()  # the last checkpoint is committed before the job ends
        if rank == 0 and store.latest_step() is not None:
            say(f"saved {store.path(store.latest_step())}")
    if args.compare:
        del state, model, optim, sched
        # torch's Muon needs whole matrices: FSDP2's Shard(0) DTensors are not
        for impl in [i for i in IMPLS[1:] if args.optimizer != "muon" or i != "fsdp2"]:
            reset_peak_memory(device)
            model = build_model(args, impl, device)
            optim, sched = build_optimizer(args, model)
            runs.append(train(args, impl, model, optim, sched, device, 1, main_run=False))
            del model, optim, sched
    if rank == 0:
        report(args, runs, device, header, time.perf_counter() - started)
    dist.destroy_process_group()


_where: dict[str, Any] = {"impl": None, "step": None}  # for error messages


def _rank() -> str:
    if dist.is_available() and dist.is_initialized():
        return str(dist.get_rank())
    return os.environ.get("RANK", "?")


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _is_peer_failure(e: BaseException) -> bool:
    """A collective failing because another rank went away (gloo: connection
    reset/closed by peer; NCCL: remote error or abort)."""
    text = str(e)
    return isinstance(e, (dist.DistBackendError, dist.DistNetworkError)) or any(
        s in text for s in ("Connection reset by peer", "Connection closed by peer",
                            "remote process exited", "NCCL communicator was aborted"))


def main() -> None:
    args = parse_args()
    try:
        device = init_from_torchrun()
        run(args, device)
    except KeyboardInterrupt:
        print(f"\n[rank {_rank()}] interrupted (Ctrl-C){_at()}: exiting", file=sys.stderr,
              flush=True)
        _exit(130)
    except BaseException as e:  # noqa: BLE001 - any failure ends this rank, visibly
        if isinstance(e, SystemExit) and not e.code:
            raise
        if _is_peer_failure(e):
            # Secondary: the rank that failed first has printed the cause. One
            # line here, and no error file, and a short pause before exiting, so
            # that torchrun's summary names that rank as the root cause.
            print(f"[rank {_rank()}] stopped{_at()}: a collective failed, probably because "
                  f"another rank failed first (see its error): {type(e).__name__}: "
                  f"{str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr, flush=True)
            time.sleep(2)
            _exit(1)
        print(f"[rank {_rank()}] failed{_at()}: {type(e).__name__}: {e}\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # for torchrun's failure summary
            from torch.distributed.elastic.multiprocessing.errors import get_error_handler
            get_error_handler().record_exception(e)
        _exit(1)


def _at() -> str:
    if _where["step"] is None:
        return ""
    return f" at step {_where['step']}" + (
        f" ({_where['impl']} run)" if _where["impl"] != "fsdp_compose" else "")


if __name__ == "__main__":
    main()
    # Skip interpreter teardown: a process group still referenced then (the
    # model is kept alive by torch's state-dict helpers' cache and by
    # autograd hooks) is destroyed during finalisation, and gloo aborts a few
    # percent of such exits ("terminate called without an active exception")
    # after all the work is done, failing the job. Everything is flushed.
    _exit(0)
