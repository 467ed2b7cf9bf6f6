"""What a person reads from the examples: the text they print and the plot.

In one process, no process group: ``train_gpt.py``'s summary line and loss
comparison, the plain-line progress used when stderr is not a terminal, the
plot's ticks and legends, and ``lora_finetune.py``'s closing report. The
runs under torchrun that print them are in tests/repository/test_train_example.py
(train_gpt) and at the end here (lora_finetune).
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module; the examples import ``_progress``
    from their own directory, as when run as scripts."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def report() -> ModuleType:
    """``train_gpt.py``'s reporting, ``examples/_report.py`` (the script
    itself must import cleanly too)."""
    _example("train_gpt")
    return _example("_report")


@pytest.fixture(scope="module")
def progress() -> ModuleType:
    return _example("_progress")


def _args(**overrides) -> argparse.Namespace:
    return argparse.Namespace(**{"batch_per_rank": 4, "micro_batches": 1, "seq": 64,
                                 "steps": 20, **overrides})


# ------------------------------------------------------------------ summary
def test_summary_header_counts_ranks_and_the_steps_this_run_did(report):
    def header(args: argparse.Namespace, world: int, first_step: int) -> str:
        return report.summary_header(args, world, "cpu (gloo)", 1_060_000, ["fp32"],
                                        first_step)

    assert header(_args(), 2, 1) == (
        "2 ranks on cpu (gloo), 1.06M parameters, 4 x 64 tokens per rank per step, fp32, 20 steps")
    assert header(_args(steps=1), 1, 1).startswith("1 rank on cpu (gloo), ")
    assert header(_args(steps=1), 1, 1).endswith(", fp32, 1 step")
    # a checkpoint at step 60, --steps 70: 10 steps now, not 70, and where they ended
    assert header(_args(steps=70), 2, 61).endswith(
        "fp32; resumed after step 60: 10 steps run now (61-70), step 70 reached")
    assert header(_args(steps=70), 2, 70).endswith(
        "resumed after step 69: 1 step run now (70), step 70 reached")
    assert header(_args(steps=70), 2, 71).endswith(
        "resumed after step 70: no steps run now (--steps 70)")
    assert "8 x 64 tokens per rank per step (2 micro-batches)" in header(
        _args(micro_batches=2), 2, 1)


def test_loss_differences_name_identical_runs_and_the_largest_gap(report):
    run = report.RunStats
    ref = run("fsdp_compose", steps=[1, 2, 3], losses=[3.0, 2.0, 1.0])
    same = run("ddp", steps=[1, 2, 3], losses=[3.0, 2.0, 1.0])
    off = run("fsdp2", steps=[1, 2, 3], losses=[3.0, 2.25, 0.99])
    assert report.loss_differences([ref, same, off]) == (
        "largest loss difference from fsdp_compose (steps 1-3): ddp 0 (identical), fsdp2 0.25")
    # after a resume the first run has fewer steps: only the common ones count
    resumed = run("fsdp_compose", steps=[3], losses=[0.5])
    assert report.loss_differences([resumed, same]) == (
        "largest loss difference from fsdp_compose (1 step): ddp 0.5")


# ------------------------------------------------------------------ progress
_LINE = re.compile(r"^train: step (\d+)/(\d+) \((\d+)%\), \d+\.\d s, loss \d\.\d{4}$")


def _progress_lines(module, stream, total: int, initial: int = 0, **kw) -> str:
    progress = module.Progress(total, initial=initial, desc="train", file=stream, **kw)
    for step in range(initial + 1, total + 1):
        progress.step(f"loss {1 / step:.4f}")
    progress.close()
    return stream.getvalue()


def test_progress_is_one_line_per_tenth_of_the_steps_in_a_file(progress):
    """Not a terminal (a log file, a pipe): whole lines, no carriage returns."""
    text = _progress_lines(progress, io.StringIO(), 25)
    assert "\r" not in text
    lines = text.splitlines()
    assert all(_LINE.match(line) for line in lines), text
    assert [int(_LINE.match(line)[1]) for line in lines] == [3, 6, 9, 12, 15, 18, 21, 24, 25]
    assert lines[-1].startswith("train: step 25/25 (100%), ")
    # a resumed run: a tenth of the steps left, counted from the checkpoint
    resumed = _progress_lines(progress, io.StringIO(), 70, initial=60).splitlines()
    assert [int(_LINE.match(line)[1]) for line in resumed] == list(range(61, 71))
    # and at least every min_interval_s, however many steps that is
    timed = _progress_lines(progress, io.StringIO(), 100, min_interval_s=0).splitlines()
    assert len(timed) == 100


def test_progress_is_a_tqdm_bar_on_a_terminal(progress):
    pytest.importorskip("tqdm")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    text = _progress_lines(progress, Terminal(), 5)
    assert "\r" in text and "5/5" in text and not _LINE.search(text.split("\r")[-1])


# ------------------------------------------------------------------ plot
def _runs(report, steps: int, impls=("fsdp_compose", "ddp", "fsdp2")):
    runs = []
    for impl in impls:
        losses = [7.0 / s + (0.01 if impl == "fsdp2" else 0.0) for s in range(1, steps + 1)]
        rss = [[340.0 + s + k for k in range(2)] for s in range(1, steps + 1)]
        runs.append(report.RunStats(impl, steps=list(range(1, steps + 1)), losses=losses,
                                    rss=rss))
    return runs


@pytest.mark.parametrize("impls", [("fsdp_compose",), ("fsdp_compose", "ddp", "fsdp2")])
def test_plot_has_whole_step_ticks_and_legends_beside_the_data(report, impls):
    """Steps 1-20 are labelled with integers; the memory legend lies outside its
    panel (the curves span the whole width); under --compare a middle panel
    shows each run's loss minus the first one's and its legend says which are
    identical."""
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = report.plot_figure(_runs(report, 20, impls), cuda=False)
    try:
        fig.canvas.draw()
        axes = fig.axes
        assert len(axes) == (3 if len(impls) > 1 else 2)
        for ax in axes:
            ticks = [t for t in ax.get_xticks() if 1 <= t <= 20]
            assert ticks and all(t == int(t) for t in ticks), (ax.get_title(), ticks)
        mem = axes[-1]
        assert not mem.get_legend().get_window_extent().overlaps(mem.get_window_extent())
        if len(impls) > 1:
            diff = axes[1]
            assert diff.get_title() == "loss difference from fsdp_compose"
            labels = [t.get_text() for t in diff.get_legend().get_texts()]
            assert labels == ["fsdp_compose (reference)", "ddp: identical at every step",
                              "fsdp2: at most 0.01 apart"]
            assert not diff.get_legend().get_window_extent().overlaps(diff.get_window_extent())
    finally:
        plt.close(fig)


# ------------------------------------------------------------------ lora_finetune
def test_lora_report_compares_losses_and_says_what_generation_checked():
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    lora = _example("lora_finetune")
    text = lora.generation_report(
        [6.2, *[2.0] * 8, 1.9, 1.7], 512, prompt=[1, 2, 3], generated=[4, 5, 1],
        clean=[4, 5, 6], unsharded=[4, 5, 1])
    assert text.splitlines() == [
        ("loss (mean over ranks): 6.200 at step 1 -> 1.700 at step 11 "
         "(1.960 over the last 10 steps)"),
        "  (a uniform guess over the 512 tokens scores ln 512 = 6.238)",
        "greedy generation, 3 new tokens after a 3-token prompt (token ids):",
        "  prompt                     1 2 3",
        "  generated (sharded model)  4 5 1",
        "  data pattern (no noise)    4 5 6",
        "continues the training data's 5-token pattern: 2 of 3 tokens",
        "matches the unsharded model's greedy output (same weights, one process): yes",
    ]
    differs = lora.generation_report([6.2], 512, [1], [4, 5], [4, 5], unsharded=[4, 6])
    assert differs.endswith("one process): no (unsharded: 4 6)")


@pytest.mark.slow  # ~13 s; tests/tools/test_hf.py::test_lora_example_runs runs it by default
def test_lora_example_reports_the_loss_and_the_generation_check(tmp_path):
    """examples/lora_finetune.py under torchrun (tiny sizes), output to pipes:
    progress as whole lines; the report's lines; sharded == unsharded generation."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "examples/lora_finetune.py",
           "--steps", "4", "--layers", "2", "--hidden", "64", "--seq", "16"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step/s" not in proc.stderr  # no tqdm frames (text mode turns their \r into \n)
    assert re.findall(r"^LoRA: step (\d)/4 \(\d+%\)", proc.stderr, re.MULTILINE) == list("1234")
    assert re.search(r"^loss \(mean over ranks\): \d\.\d{3} at step 1 -> \d\.\d{3} at step 4 \(",
                     proc.stdout, re.MULTILINE), proc.stdout
    assert re.search(r"^continues the training data's 5-token pattern: \d+ of 10 tokens$",
                     proc.stdout, re.MULTILINE), proc.stdout
    assert ("matches the unsharded model's greedy output (same weights, one process): yes"
            in proc.stdout), proc.stdout
