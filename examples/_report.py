"""What ``train_gpt.py`` reports at the end: the measurements of one run
(:class:`RunStats`), the summary line and table, the loss differences
between implementations, ``summary.json`` and the loss/memory plot."""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from _memory import per_rank
from _progress import say


@dataclass
class RunStats:
    """What one implementation's run measured (rank 0 has every rank's memory)."""

    impl: str
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    rss: list[list[float]] = field(default_factory=list)       # per step, per rank (MiB)
    cuda: list[list[float]] = field(default_factory=list)      # per step, per rank (MiB), CUDA only
    peak_rss: list[float] = field(default_factory=list)        # per rank (MiB)
    peak_cuda: list[float] = field(default_factory=list)       # per rank (MiB), CUDA only
    tokens_per_step: int = 0

    @property
    def mean_step_s(self) -> float:
        times = self.step_seconds[1:] or self.step_seconds  # step 1 is a warm-up
        return sum(times) / len(times) if times else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.mean_step_s

    def as_dict(self) -> dict[str, Any]:
        return {"impl": self.impl, "steps": self.steps, "losses": self.losses,
                "final_loss": self.losses[-1] if self.losses else None,
                "step_seconds": self.step_seconds, "mean_step_s": self.mean_step_s,
                "tokens_per_s": self.tokens_per_s, "rss_mib": self.rss, "cuda_mib": self.cuda,
                "peak_rss_mib": self.peak_rss, "peak_cuda_mib": self.peak_cuda}



def plural(n: int, word: str) -> str:
    """``"1 rank"``, ``"2 ranks"``."""
    return f"{n} {word}" + ("" if n == 1 else "s")


def summary_header(args: argparse.Namespace, world: int, where: str, n_params: int,
                   options: list[str], first_step: int) -> str:
    """The summary's first line, less the time: the job, the options and the
    steps this invocation ran. From scratch that is ``"20 steps"``; after
    ``--resume`` it is the steps run now and the step reached, since a
    checkpoint at step 60 and ``--steps 70`` run 10 steps, not 70."""
    batch = args.batch_per_rank * args.micro_batches
    job = (f"{plural(world, 'rank')} on {where}, {n_params / 1e6:.2f}M parameters, "
           f"{batch} x {args.seq} tokens per rank per step"
           + (f" ({args.micro_batches} micro-batches)" if args.micro_batches > 1 else "")
           + f", {', '.join(options)}")
    ran = args.steps - first_step + 1
    if first_step == 1:
        return f"{job}, {plural(args.steps, 'step')}"
    if ran <= 0:
        return (f"{job}; resumed after step {first_step - 1}: no steps run now "
                f"(--steps {args.steps})")
    span = f"{first_step}-{args.steps}" if ran > 1 else f"{args.steps}"
    return (f"{job}; resumed after step {first_step - 1}: {plural(ran, 'step')} run now ({span}), "
            f"step {args.steps} reached")


def loss_differences(runs: list[RunStats]) -> str:
    """``"largest loss difference from fsdp_compose (steps 1-20): ddp 0 (identical),
    fsdp2 2.4e-07"``: each other run against the first, over the steps both ran."""
    ref = dict(zip(runs[0].steps, runs[0].losses))
    parts, common = [], sorted(ref)
    for r in runs[1:]:
        diffs = [abs(loss - ref[step]) for step, loss in zip(r.steps, r.losses) if step in ref]
        common = [s for s in common if s in r.steps]
        if not diffs:
            parts.append(f"{r.impl} -")
        else:
            worst = max(diffs)
            parts.append(f"{r.impl} {worst:.2g}" + (" (identical)" if worst == 0 else ""))
    span = f"steps {common[0]}-{common[-1]}" if len(common) > 1 else plural(len(common), "step")
    return f"largest loss difference from {runs[0].impl} ({span}): {', '.join(parts)}"


def summary_table(runs: list[RunStats], device: torch.device) -> str:
    cuda = device.type == "cuda"
    header = ["impl", "final loss", "step (ms)", "tokens/s", "peak RSS/rank (MiB)"]
    if cuda:
        header.append("peak CUDA/rank (MiB)")
    rows = []
    for r in runs:
        row = [r.impl, f"{r.losses[-1]:.6f}" if r.losses else "-",
               f"{r.mean_step_s * 1000:.1f}", f"{r.tokens_per_s:,.0f}",
               per_rank(r.peak_rss, "", " / ")]
        if cuda:
            row.append(per_rank(r.peak_cuda, "", " / "))
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    rule = "-" * len(fmt(header))
    return "\n".join([rule, fmt(header), rule, *map(fmt, rows), rule])


def plot(runs: list[RunStats], path: Path, cuda: bool) -> Optional[Path]:
    """Write ``plot_figure`` to ``path``; without matplotlib say how to get it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed: no plot (install it with `pip install -e '.[bench]'`)")
        return None
    fig = plot_figure(runs, cuda)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight": keep the legends outside the axes
    plt.close(fig)
    return path


def plot_figure(runs: list[RunStats], cuda: bool):
    """The loss curves and each rank's memory per step; with more than one run
    (``--compare``) also each run's loss minus the first run's, since equal
    losses (fp32 usually gives bit-identical ones) draw as one curve. The
    memory legend sits right of its panel: the curves fill the whole width."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    compare = len(runs) > 1
    fig, axes = plt.subplots(1, 3 if compare else 2, figsize=(15.5 if compare else 10.5, 4),
                             sharex=True)
    ax_loss, ax_mem = axes[0], axes[-1]
    dashes = ("-", "--", ":", "-.")
    for n, r in enumerate(runs):  # the first wide, the others narrower on top: all stay visible
        ax_loss.plot(r.steps, r.losses, color=f"C{n}", linestyle=dashes[n % 4],
                     linewidth=3 if compare and n == 0 else 1.5, label=r.impl)
    ax_loss.set(xlabel="step", ylabel="loss (mean over ranks)", title="training loss")
    ax_loss.legend(fontsize="small")

    if compare:
        ax_diff, ref = axes[1], dict(zip(runs[0].steps, runs[0].losses))
        ax_diff.plot(runs[0].steps, [0.0] * len(runs[0].steps), color="C0", linewidth=3,
                     label=f"{runs[0].impl} (reference)")
        for n, r in enumerate(runs[1:], 1):
            steps = [s for s in r.steps if s in ref]
            diffs = [loss - ref[s] for s, loss in zip(r.steps, r.losses) if s in ref]
            worst = max(map(abs, diffs), default=0.0)
            ax_diff.plot(steps, diffs, color=f"C{n}", linestyle=dashes[n % 4], marker="ox+"[n % 3],
                         fillstyle="none", label=f"{r.impl}: " + (
                             f"at most {worst:.2g} apart" if worst else "identical at every step"))
        ax_diff.set(xlabel="step", ylabel=f"loss - {runs[0].impl}'s loss",
                    title=f"loss difference from {runs[0].impl}")
        ax_diff.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax_diff.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2))

    mems = [r.cuda if cuda else r.rss for r in runs]  # per run: per step, per rank
    world = max((len(mem[0]) for mem in mems if mem), default=0)
    each_rank = world <= len(dashes)  # else one line per run: the largest rank's
    for n, (r, mem) in enumerate(zip(runs, mems)):
        if each_rank:
            for k in range(world):
                ax_mem.plot(r.steps, [m[k] for m in mem], color=f"C{n}", linestyle=dashes[k])
        else:
            ax_mem.plot(r.steps, [max(m) for m in mem], color=f"C{n}")
    # one entry per run (colour) and per rank (line style) rather than one per pair
    handles = [Line2D([], [], color=f"C{n}", label=r.impl) for n, r in enumerate(runs)]
    if each_rank:
        handles += [Line2D([], [], color="grey", linestyle=dashes[k], label=f"rank {k}")
                    for k in range(world)]
    else:
        handles.append(Line2D([], [], color="grey", label="max over ranks"))
    ax_mem.legend(handles=handles, fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1),
                  borderaxespad=0)
    ax_mem.set(xlabel="step", ylabel="MiB",
               title="allocated CUDA memory" if cuda else "process RSS (resident memory)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))  # whole steps
    fig.tight_layout()
    return fig


def default_out_dir() -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = Path("runs") / f"train_gpt-{stamp}"
    n = 1
    while path.exists():
        path = Path("runs") / f"train_gpt-{stamp}-{n}"
        n += 1
    return path


def report(args: argparse.Namespace, runs: list[RunStats], device: torch.device,
           header: str, wall_s: float) -> None:
    """Rank 0: the table, summary.json and the plot."""
    cuda = device.type == "cuda"
    out = Path(args.out_dir) if args.out_dir else default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    print(f"\nsummary: {header}, {wall_s:.1f} s in all", flush=True)
    if runs[0].losses:
        print(summary_table(runs, device), flush=True)
        if len(runs) > 1:
            print(loss_differences(runs), flush=True)
            if runs[0].steps[0] != 1:
                print(f"{', '.join(r.impl for r in runs[1:])} trained from step 1 "
                      f"({runs[0].impl} resumed after step {runs[0].steps[0] - 1})", flush=True)
        if args.mixed_precision != "none" and any(r.impl == "ddp" for r in runs):
            print("ddp ran in fp32 (DDP has no mixed-precision policy)", flush=True)
    else:
        print("(no steps run: nothing to summarise)", flush=True)
    (out / "summary.json").write_text(json.dumps(
        {"args": vars(args), "world_size": dist.get_world_size(), "device": str(device),
         "runs": [r.as_dict() for r in runs]}, indent=1))
    print(f"wrote {out / 'summary.json'}", flush=True)
    if runs[0].losses:
        png = plot(runs, out / "train_gpt.png", cuda)
        if png is not None:
            print(f"wrote {png}", flush=True)

