"""Turn the raw per-rank measurements of one scenario into a summary, a table
on stdout, ``<scenario>.json`` and ``<scenario>.png``. Used by
``benchmarks/run.py``; to redraw a plot and reprint the table from a saved
JSON file without re-running anything:

    .venv/bin/python -m benchmarks.report benchmarks/results/default.json

Definitions (per implementation):

* step time: wall time of forward + backward + ``optim.step()`` +
  ``zero_grad()``, the max over ranks, after a barrier that is not timed.
  Each round's value is the median of its steps; the figure is the median
  over rounds, the spread is the min..max over rounds;
* ratio to DDP / FSDP2: the median over rounds of (this implementation's
  round value / theirs in the same round): paired, so that slow phases of the
  machine cancel out;
* tokens/s: global tokens per step (ranks x batch x seq) / step time;
* peak: the steady-state training peak of live tensor bytes on each rank
  (memory pass; see ``memory.py``), persistent: live bytes after a step;
* loss diff: max over the reference's steps of |global mean loss - loss of
  one process training on the global batch|.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch

MiB = 2 ** 20
LABELS = {"fsdp_compose": "fsdp_compose", "fsdp2": "FSDP2", "fsdp1": "FSDP1", "ddp": "DDP",
          "fsdp_compose_rs": "fsdp_compose (gloo RS)",
          "fsdp_compose_retain": "fsdp_compose (retain pool)",
          "fsdp_compose_bf16": "fsdp_compose bf16/fp32 RS",
          "fsdp_compose_bf16comm": "fsdp_compose bf16/bf16 RS",
          "fsdp_compose_nobucket": "fsdp_compose (no buckets)",
          "fsdp_compose_bucket1": "fsdp_compose (buckets 1 MiB)",
          "fsdp_compose_bucket4": "fsdp_compose (buckets 4 MiB)",
          "fsdp_compose_int8w": "fsdp_compose int8 all-gather",
          "fsdp_compose_int8": "fsdp_compose int8 both",
          "fsdp_compose_fp8": "fsdp_compose fp8 both",
          "fsdp_compose_split": "fsdp_compose (split root)",
          "fsdp_compose_rsgroup": "fsdp_compose (reduce-scatters on their own group)",
          "compute_alone": "compute alone (no collective)"}


# -------------------------------------------------------------- environment
def environment(world: int) -> dict[str, Any]:
    """Machine and code, taken at start-up, when the ranks import the library
    (its files may change while the benchmark runs)."""
    import fsdp_compose
    repo = Path(__file__).resolve().parent.parent
    source = Path(fsdp_compose.__file__).resolve().parent
    in_repo = source == repo / "fsdp_compose"
    return {
        "ranks": world,
        "threads_per_rank": torch.get_num_threads(),
        "backend": "gloo (CPU)",
        "nproc": _nproc(),
        "cpu_model": _cpu_model(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_commit": _git(repo, "rev-parse", "--short", "HEAD"),
        "fsdp_compose_last_commit": _git(repo, "log", "-1", "--format=%h %s", "--", "fsdp_compose"),
        "fsdp_compose_source": str(source),
        "fsdp_compose_dirty": (bool(_git(repo, "status", "--porcelain", "--", "fsdp_compose"))
                               if in_repo else None),
    }


def start_clock(env: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``env`` with the start time and load average of a scenario."""
    return env | {"started": datetime.datetime.now().isoformat(timespec="seconds"),
                  "loadavg_1min_before_after": [round(os.getloadavg()[0], 2)]}


def stop_clock(env: dict[str, Any]) -> None:
    """Add the duration and the load average at the end of a scenario."""
    started = datetime.datetime.fromisoformat(env["started"])
    env["duration_s"] = round((datetime.datetime.now() - started).total_seconds(), 1)
    env["loadavg_1min_before_after"].append(round(os.getloadavg()[0], 2))


def _nproc() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(repo: Path, *args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# ------------------------------------------------------------------ summary
def summarize(s, raw: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
    """Figures per implementation from the raw per-rank results (rank 0)."""
    timing, memory, ref = raw["timing"], raw["memory"], raw["reference"]
    tokens = env["ranks"] * s.batch_per_rank * s.cfg.seq_len
    rows: dict[str, dict[str, Any]] = {}
    round_values: dict[str, dict[int, float]] = {}
    global_losses: dict[str, list[float]] = {}
    for name in s.impls:
        per_rank = [t["phases"][name] for t in timing]
        n = len(per_rank[0])
        steps = [max(sum(r[i]) for r in per_rank) for i in range(n)]
        phase = [[max(r[i][k] for r in per_rank) for i in range(n)] for k in range(3)]
        by_round: dict[int, list[float]] = {}
        for value, rnd in zip(steps, timing[0]["rounds"][name]):
            by_round.setdefault(rnd, []).append(value)
        round_values[name] = {r: statistics.median(v) for r, v in by_round.items()}
        step_s = statistics.median(round_values[name].values())
        losses = [statistics.fmean(vals) for vals in zip(*(t["losses"][name] for t in timing))]
        global_losses[name] = losses
        compared = min(len(losses), len(ref["losses"]))
        rows[name] = {
            "step_ms": 1e3 * step_s,
            "step_ms_rounds": [1e3 * v for _, v in sorted(round_values[name].items())],
            "forward_ms": 1e3 * statistics.median(phase[0]),
            "backward_ms": 1e3 * statistics.median(phase[1]),
            "optimizer_ms": 1e3 * statistics.median(phase[2]),
            "tokens_per_s": tokens / step_s,
            "peak_mib_per_rank": [m[name]["train_peak"] / MiB for m in memory],
            "persistent_mib_per_rank": [m[name]["persistent"] / MiB for m in memory],
            "setup_peak_mib_per_rank": [m[name]["setup_peak"] / MiB for m in memory],
            "rss_peak_growth_mib_per_rank": [m[name].get("rss_peak_growth", 0) / MiB
                                             for m in memory],
            "rss_held_mib_per_rank": [m[name].get("rss_held_after", 0) / MiB for m in memory],
            "minor_faults_per_step_per_rank": [m[name].get("minor_faults_per_step", 0)
                                               for m in memory],
            "tracker_peak_mib_per_rank": [m[name].get("tracker_peak", 0) / MiB for m in memory],
            "tracker_after_mib_per_rank": [m[name].get("tracker_after", 0) / MiB for m in memory],
            "direct_after_mib_per_rank": [m[name].get("direct_after", 0) / MiB for m in memory],
            "losses": losses,
            "max_loss_diff_vs_reference": max(abs(a - b) for a, b in
                                              zip(losses[:compared], ref["losses"][:compared])),
            "loss_steps_compared": compared,
        }
    for name, row in rows.items():
        for other in ("ddp", "fsdp2"):
            if other in round_values:
                ratios = [v / round_values[other][r] for r, v in round_values[name].items()]
                row[f"ratio_to_{other}"] = statistics.median(ratios)
        if "ddp" in global_losses:
            row["max_loss_diff_vs_ddp_all_steps"] = max(
                abs(a - b) for a, b in zip(global_losses[name], global_losses["ddp"]))
    bounds = ref["bounds"]
    return {
        "scenario": s.scenario,
        "model": {"n_layers": s.cfg.n_layers, "d_model": s.cfg.d_model,
                  "n_heads": s.cfg.n_heads, "vocab_size": s.cfg.vocab_size,
                  "seq_len": s.cfg.seq_len, "params_m": bounds["params_total"] / 4 / 1e6},
        "settings": {"batch_per_rank": s.batch_per_rank, "lr": s.lr, "seed": s.seed,
                     "optimizer": "AdamW", "warmup": s.warmup, "rounds": s.rounds,
                     "steps_per_round": s.steps, "ref_steps": s.ref_steps,
                     "mem_steps": s.mem_steps, "tokens_per_step": tokens},
        "environment": env,
        "reference_losses": ref["losses"],
        "analytic_mib": {k: v / MiB for k, v in bounds.items()},
        "memory_method": "torch.profiler(profile_memory=True) events carrying c10's live CPU "
                         "bytes over every thread (total_allocated), from before model "
                         "construction; peak over steps 2..mem_steps",
        "results": rows,
    }


# ------------------------------------------------------------------ outputs
def table(summary: dict[str, Any]) -> str:
    """The main table (markdown) plus the analytic memory line."""
    res = summary["results"]
    head = ("| impl | step ms (median) | rounds min..max | fwd / bwd / opt ms | tokens/s "
            "| x DDP | x FSDP2 | peak MiB r0 / r1 | persistent MiB r0 / r1 | max loss diff |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in res.items():
        rounds = r["step_ms_rounds"]
        lines.append(
            f"| {LABELS.get(name, name)} | {r['step_ms']:.1f} | {min(rounds):.1f}..{max(rounds):.1f} "
            f"| {r['forward_ms']:.1f} / {r['backward_ms']:.1f} / {r['optimizer_ms']:.1f} "
            f"| {r['tokens_per_s']:.0f} | {_ratio(r, 'ddp')} | {_ratio(r, 'fsdp2')} "
            f"| {' / '.join(f'{v:.1f}' for v in r['peak_mib_per_rank'])} "
            f"| {' / '.join(f'{v:.1f}' for v in r['persistent_mib_per_rank'])} "
            f"| {r['max_loss_diff_vs_reference']:.1e} |")
    if all("rss_peak_growth_mib_per_rank" in r for r in res.values()):
        lines += ["", "| impl | RSS peak growth MiB r0 / r1 | RSS held after MiB r0 / r1 "
                  "| minor page faults / step r0 / r1 |", "|---|---|---|---|"]
        for name, r in res.items():
            lines.append(
                f"| {LABELS.get(name, name)} "
                f"| {' / '.join(f'{v:.1f}' for v in r['rss_peak_growth_mib_per_rank'])} "
                f"| {' / '.join(f'{v:.1f}' for v in r['rss_held_mib_per_rank'])} "
                f"| {' / '.join(f'{v / 1e3:.1f}k' for v in r['minor_faults_per_step_per_rank'])} |")
    if all(r.get("tracker_after_mib_per_rank") for r in res.values()):
        lines += ["", "| impl | MemTracker peak MiB r0 / r1 | MemTracker after step MiB r0 / r1 "
                  "| direct count after step MiB r0 / r1 (params + grads + optimizer state) "
                  "| after step, tracker / direct | peak, tracker / profiler |",
                  "|---|---|---|---|---|---|"]
        for name, r in res.items():
            agree = [t / d if d else 0.0 for t, d in zip(r["tracker_after_mib_per_rank"],
                                                         r["direct_after_mib_per_rank"])]
            peaks = [t / p if p else 0.0 for t, p in zip(r["tracker_peak_mib_per_rank"],
                                                         r["peak_mib_per_rank"])]
            lines.append(
                f"| {LABELS.get(name, name)} "
                f"| {' / '.join(f'{v:.1f}' for v in r['tracker_peak_mib_per_rank'])} "
                f"| {' / '.join(f'{v:.1f}' for v in r['tracker_after_mib_per_rank'])} "
                f"| {' / '.join(f'{v:.1f}' for v in r['direct_after_mib_per_rank'])} "
                f"| {' / '.join(f'{v:.3f}' for v in agree)} "
                f"| {' / '.join(f'{v:.3f}' for v in peaks)} |")
    a = summary["analytic_mib"]
    lines.append("")
    lines.append(
        f"Analytic per rank: sharded params+grads+AdamW(2x) {a['sharded_state']:.1f} MiB; "
        f"+ two largest units unsharded (params+grads) {a['two_largest_units']:.1f}; "
        f"+ activations (measured saved tensors) {a['activations']:.1f}; "
        f"+ logits grad {a['logits_grad']:.1f} = FSDP bound {a['fsdp_bound']:.1f} MiB. "
        f"DDP: replicated state + buckets {a['ddp_state']:.1f} -> {a['ddp_bound']:.1f} MiB.")
    return "\n".join(lines)


def _ratio(row: dict[str, Any], other: str) -> str:
    value = row.get(f"ratio_to_{other}")
    return "-" if value is None else f"{value:.2f}"


def plot(summary: dict[str, Any], path: Path) -> bool:
    """Two panels: step time per implementation (bar = median, dots = rounds)
    and per-rank memory (peak, persistent part hatched, analytic bounds)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    res = summary["results"]
    names = list(res)
    labels = [LABELS.get(n, n) for n in names]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    m = summary["model"]
    fig.suptitle(f"{summary['scenario']}: GPT {m['n_layers']} layers, d={m['d_model']}, "
                 f"vocab {m['vocab_size']}, seq {m['seq_len']}, {m['params_m']:.1f}M params; "
                 f"{summary['environment']['ranks']} CPU ranks (gloo)", fontsize=10)

    xs = range(len(names))
    ax_t.bar(xs, [res[n]["step_ms"] for n in names], color="tab:blue", alpha=0.7,
             label="median over rounds")
    for x, n in zip(xs, names):
        rounds = res[n]["step_ms_rounds"]
        ax_t.scatter([x] * len(rounds), rounds, color="black", s=10, zorder=3,
                     label="round medians" if x == 0 else None)
    for x, n in zip(xs, names):
        ax_t.annotate(f"{res[n]['step_ms']:.0f} ms", (x, 0), ha="center", va="bottom",
                      fontsize=8, color="white", xytext=(0, 4), textcoords="offset points")
    ax_t.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=8)
    ax_t.set_ylim(0, 1.15 * max(max(res[n]["step_ms_rounds"]) for n in names))
    ax_t.set_ylabel("step time (ms)")
    ax_t.set_title("step time (lower is better)")
    ax_t.legend(fontsize=8)

    ranks = len(res[names[0]]["peak_mib_per_rank"])
    width = 0.8 / ranks
    for r in range(ranks):
        pos = [x - 0.4 + width * (r + 0.5) for x in xs]
        ax_m.bar(pos, [res[n]["peak_mib_per_rank"][r] for n in names], width,
                 color=f"C{r + 1}", alpha=0.7, label=f"rank {r} peak")
        ax_m.bar(pos, [res[n]["persistent_mib_per_rank"][r] for n in names], width,
                 fill=False, hatch="//", edgecolor="black", linewidth=0,
                 label="persistent (between steps)" if r == 0 else None)
    a = summary["analytic_mib"]
    ax_m.axhline(a["fsdp_bound"], color="tab:green", linestyle="--", label="FSDP analytic bound")
    ax_m.axhline(a["sharded_state"], color="tab:green", linestyle=":",
                 label="sharded params+grads+AdamW")
    ax_m.axhline(a["ddp_bound"], color="tab:red", linestyle="--", label="DDP analytic bound")
    ax_m.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=8)
    top = max(a["ddp_bound"], *(max(res[n]["peak_mib_per_rank"]) for n in names))
    ax_m.set_ylim(0, 1.45 * top)
    ax_m.set_ylabel("MiB per rank (live tensor bytes)")
    ax_m.set_title("peak memory, measured in a separate pass")
    ax_m.legend(fontsize=7, ncol=2, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(summary: dict[str, Any], raw: dict[str, Any], out_dir: Path,
          log: Callable[[str], None] = print) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    name = summary["scenario"]
    json_path, png_path = out_dir / f"{name}.json", out_dir / f"{name}.png"
    json_path.write_text(json.dumps(summary | {"raw": raw}, indent=1) + "\n")
    log(f"\n== {name} ==  ({summary['environment']['duration_s']} s)")
    log(table(summary))
    log(f"wrote {json_path}")
    if plot(summary, png_path):
        log(f"wrote {png_path}")
    else:
        log("matplotlib is not installed: no plot (pip install -e '.[bench]')")


def record(summary: dict[str, Any], argv: list[str]) -> None:
    """Write the scenario's table of record (``benchmarks/record.py``)."""
    from benchmarks.record import write_record
    res, model, env = summary["results"], summary["model"], summary["environment"]
    ddp = res.get("ddp")
    write_record(
        f"cpu-step-{summary['scenario']}", order=1 if summary["scenario"] == "default" else 2,
        question=(f"CPU step vs DDP and FSDP2, {summary['scenario']} model ({model['n_layers']} x "
                  f"d{model['d_model']}, vocab {model['vocab_size']}; {model['params_m']:.1f}M params)"),
        command="PYTHONPATH=. .venv/bin/python -m benchmarks.run " + " ".join(argv),
        calibration=(f"DDP's step on this machine: {ddp['step_ms']:.1f} ms" if ddp else
                     "DDP was not in this run (add ddp to --impls)"),
        machine=(f"{env['nproc']}-core {env['cpu_model']}, torch {env['torch']}, CPython "
                 f"{env['python']}, {env['ranks']} gloo ranks; load average "
                 f"{env['loadavg_1min_before_after'][0]} at the start"),
        columns=["impl", "step ms (median)", "rounds (min..max)", "x DDP", "x FSDP2",
                 "peak MiB per rank", "max loss diff"],
        rows=[[LABELS.get(name, name), f"{r['step_ms']:.1f}",
               f"{min(r['step_ms_rounds']):.1f}..{max(r['step_ms_rounds']):.1f}",
               _ratio(r, "ddp"), _ratio(r, "fsdp2"), " / ".join(f"{v:.1f}" for v in r["peak_mib_per_rank"]),
               f"{r['max_loss_diff_vs_reference']:.1e}"] for name, r in res.items()])


def main(argv: list[str]) -> None:
    for path in map(Path, argv):
        summary = json.loads(path.read_text())
        print(f"== {summary['scenario']} ==")
        print(table(summary))
        if plot(summary, path.with_suffix(".png")):
            print(f"wrote {path.with_suffix('.png')}")


if __name__ == "__main__":
    main(sys.argv[1:])
