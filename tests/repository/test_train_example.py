"""``examples/train_gpt.py`` end to end on 2 gloo ranks (a tiny GPT), each started as
torchrun starts a worker (``tests/_torchrun_env.py``: its environment, store and
``__main__``, the ranks forked from the harness's server); a failing rank and
Ctrl-C under ``torchrun`` itself, whose agent is what ends the job there.

One ``--compare`` run (fsdp_compose, then torch DDP and torch FSDP2 on the
same steps) is the baseline the other runs are checked against: gradient
accumulation, activation checkpointing and ``--reshard-after-forward false``
must reproduce its losses, bf16 must stay close to them. A failing rank must
end the job promptly, non-zero, with its error shown.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

from tests._torchrun_env import run_like_torchrun

ROOT = Path(__file__).resolve().parents[2]
# tests/checkpoint/test_checkpoint_store.py's model and schedule, 6 steps of 4 rows per rank.
SMALL = ["--layers", "2", "--width", "32", "--heads", "2", "--vocab", "97", "--seq", "16",
         "--batch-per-rank", "2", "--warmup", "2", "--min-lr-ratio", "0.1", "--decay-steps", "8"]
STEPS = 6
_LOSS = re.compile(r"^step (\d+) loss (\S+)$", re.MULTILINE)
_ROW = re.compile(r"^(fsdp_compose|ddp|fsdp2) +(\S+) +(\S+) +(\S+) +(.+)$", re.MULTILINE)
_PROGRESS = re.compile(r"^(fsdp_compose|ddp|fsdp2): step (\d+)/(\d+) \(\d+%\), \d+\.\d s, "
                       r"loss \d+\.\d{4}, [\d,]+ tok/s, rss \d+M \d+M$", re.MULTILINE)


def _torchrun(out_dir: Path, *args: str, env: dict[str, str] | None = None,
              check: bool = True, timeout: float = 240) -> subprocess.CompletedProcess:
    """The example on 2 ranks in torchrun's environment (tests/_torchrun_env.py)."""
    proc = run_like_torchrun(2, "examples/train_gpt.py", *SMALL, "--steps", str(STEPS),
                             "--out-dir", str(out_dir), *args, cwd=ROOT, env=env, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _failing_torchrun(out_dir: Path, *args: str, failure: str, timeout: float
                      ) -> tuple[subprocess.CompletedProcess, Optional[float]]:
    """The example under torchrun itself (for what its agent does when a rank
    fails), and the seconds from the first stdout line holding ``failure`` to
    the job's end (``None``: never printed). Holding, not starting with: the
    ranks share the pipe, so another rank's text may precede it on its line."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "examples/train_gpt.py",
           *SMALL, "--steps", str(STEPS), "--out-dir", str(out_dir), *args]
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        killer = threading.Timer(timeout, proc.kill)  # a hung job still ends the test
        killer.start()
        lines, failed_at = [], None
        try:
            for line in proc.stdout:
                lines.append(line)
                if failed_at is None and failure in line:
                    failed_at = time.monotonic()
            proc.wait()
        finally:
            killer.cancel()
        ended_at = time.monotonic()
        stderr.seek(0)
        completed = subprocess.CompletedProcess(cmd, proc.returncode, "".join(lines), stderr.read())
    return completed, None if failed_at is None else ended_at - failed_at


def _losses(stdout: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in _LOSS.findall(stdout)}


def _assert_trained(proc: subprocess.CompletedProcess, out_dir: Path) -> dict[int, float]:
    """Every step printed, finite, decreasing overall; the summary table and files."""
    losses = _losses(proc.stdout)
    assert sorted(losses) == list(range(1, STEPS + 1)), proc.stdout
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[STEPS] < losses[1] - 0.2, losses
    assert "summary: 2 ranks on cpu (gloo)" in proc.stdout
    rows = {m[0]: m for m in _ROW.findall(proc.stdout)}
    assert float(rows["fsdp_compose"][1]) == pytest.approx(losses[STEPS], abs=1e-6)
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["runs"][0]["impl"] == "fsdp_compose"
    assert summary["runs"][0]["losses"] == [losses[s] for s in range(1, STEPS + 1)]
    assert all(v > 0 for v in summary["runs"][0]["peak_rss_mib"])
    return losses


@pytest.fixture(scope="module")
def compare(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The baseline: 4 rows per rank in one micro-batch, then DDP and FSDP2."""
    out = tmp_path_factory.mktemp("compare")
    return _torchrun(out, "--batch-per-rank", "4", "--compare"), out


def test_compare_prints_a_table_and_the_implementations_agree(compare):
    proc, out = compare
    losses = _assert_trained(proc, out)
    rows = {m[0]: m for m in _ROW.findall(proc.stdout)}
    assert list(rows) == ["fsdp_compose", "ddp", "fsdp2"], proc.stdout
    for impl, (_, final, step_ms, tokens_s, peak) in rows.items():
        assert float(final) == pytest.approx(losses[STEPS], abs=1e-4), impl
        assert float(step_ms) > 0 and float(tokens_s.replace(",", "")) > 0, impl
        assert len(peak.split(" / ")) == 2, impl  # one peak RSS per rank
    summary = json.loads((out / "summary.json").read_text())
    assert [r["impl"] for r in summary["runs"]] == ["fsdp_compose", "ddp", "fsdp2"]
    for run in summary["runs"]:
        assert run["steps"] == list(range(1, STEPS + 1))
        for got, want in zip(run["losses"], summary["runs"][0]["losses"], strict=True):
            assert got == pytest.approx(want, abs=1e-4), run["impl"]
    assert (out / "train_gpt.png").exists() == ("wrote " + str(out / "train_gpt.png") in proc.stdout)
    gaps = re.search(r"^largest loss difference from fsdp_compose \(steps 1-6\): "
                     r"ddp (\S+)( \(identical\))?, fsdp2 (\S+)( \(identical\))?$",
                     proc.stdout, re.MULTILINE)
    assert gaps and float(gaps[1]) <= 1e-4 and float(gaps[3]) <= 1e-4, proc.stdout


def test_progress_in_a_file_is_whole_lines(compare):
    """stderr is a pipe here, as in a CI log or under nohup: no tqdm frames
    (carriage returns, which text mode reads as newlines: look for tqdm's
    rate instead), but a line per tenth of the steps for each run."""
    proc, _ = compare
    assert "step/s" not in proc.stderr, proc.stderr[-2000:]
    lines = _PROGRESS.findall(proc.stderr)
    assert [(impl, int(step)) for impl, step, _ in lines] == [
        (impl, step) for impl in ("fsdp_compose", "ddp", "fsdp2") for step in range(1, STEPS + 1)]
    assert {total for _, _, total in lines} == {str(STEPS)}


_README_DEMO = re.compile(r"`make demo`.*? ends with\n\n```text\n(.*?)```", re.DOTALL)


def _shape(line: str) -> str:
    """A printed line with its numbers masked and its spacing collapsed: what
    stays the same from run to run (and for another model size)."""
    if line.strip() and set(line.strip()) == {"-"}:
        return "<rule>"
    return " ".join(re.sub(r"\d[\d,.]*", "#", line).split())


def test_readme_shows_what_the_demo_prints(tmp_path):
    """README.md's ``make demo`` block is how the demo's output ends: the
    same lines, words and columns (numbers and the run's time stamp aside).
    The demo as ``make demo`` runs it (its default options, no --out-dir:
    ``runs/train_gpt-<time>/``), a smaller model for fewer seconds."""
    pytest.importorskip("matplotlib")  # the `examples` extra, which `make demo` installs
    shown = _README_DEMO.search((ROOT / "README.md").read_text())
    assert shown, "README.md has no ```text block after `make demo` ... ends with"
    proc = run_like_torchrun(2, str(ROOT / "examples" / "train_gpt.py"), *SMALL,
                             "--steps", str(STEPS), cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    want = [_shape(line) for line in shown[1].rstrip("\n").splitlines()]
    got = [_shape(line) for line in proc.stdout.rstrip("\n").splitlines()][-len(want):]
    assert got == want, ("README.md's demo output is not what the demo prints:\n--- README\n"
                         + shown[1] + "--- printed (the end)\n"
                         + "\n".join(proc.stdout.rstrip("\n").splitlines()[-len(want):]))
    assert len(list(tmp_path.glob("runs/train_gpt-*/summary.json"))) == 1


@pytest.mark.slow  # two torchrun jobs, ~15 s; the text itself: tests/repository/test_example_output.py
def test_resumed_run_says_the_steps_run_now_and_the_step_reached(tmp_path):
    """A checkpoint after step 4, then --steps 6 --resume: 2 steps ran, not 6."""
    ckpt = str(tmp_path / "ckpt")
    _torchrun(tmp_path / "first", "--steps", "4", "--ckpt-dir", ckpt, "--save-every", "4",
              "--no-progress")
    proc = _torchrun(tmp_path / "second", "--ckpt-dir", ckpt, "--resume", "--no-progress")
    assert sorted(_losses(proc.stdout)) == [5, 6]
    summary = re.search(r"^summary: (.*)$", proc.stdout, re.MULTILINE)[1]
    assert summary.startswith("2 ranks on cpu (gloo), ")
    assert "; resumed after step 4: 2 steps run now (5-6), step 6 reached, " in summary, summary
    assert f"{STEPS} steps" not in summary


@pytest.mark.slow  # accumulation parity: tests/core/test_parity.py
def test_micro_batches_equal_a_doubled_batch(compare, tmp_path):
    """2 micro-batches of 2 rows (sync on the last only, each loss / 2) train exactly
    like one batch of 4 rows per rank: the same loss at every step."""
    want = _losses(compare[0].stdout)
    proc = _torchrun(tmp_path, "--micro-batches", "2")  # --batch-per-rank 2 from SMALL
    got = _assert_trained(proc, tmp_path)
    assert "(2 micro-batches)" in proc.stdout
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], abs=1e-5), step


@pytest.mark.parametrize("flags", [
    pytest.param(("--activation-checkpointing",), marks=pytest.mark.slow),
    ("--reshard-after-forward", "false"),
    pytest.param(("--mixed-precision", "bf16"), marks=pytest.mark.slow),
])
def test_training_options(compare, tmp_path, flags):
    """Each option trains; checkpointing and resharding change no number, bf16 a little.
    The resharding run hides matplotlib: no plot, a hint how to install it instead."""
    want = _losses(compare[0].stdout)
    env = None
    if flags[0] == "--reshard-after-forward":
        shim = tmp_path / "no_matplotlib" / "matplotlib"
        shim.mkdir(parents=True)
        (shim / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
        env = {"PYTHONPATH": f"{shim.parent}{os.pathsep}{ROOT}"}
    proc = _torchrun(tmp_path, "--batch-per-rank", "4", *flags, env=env)
    got = _assert_trained(proc, tmp_path)
    tolerance = 0.05 if "bf16" in flags else 1e-5
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], abs=tolerance), step
    if env is not None:
        assert "pip install -e '.[bench]'" in proc.stdout
        assert not (tmp_path / "train_gpt.png").exists()


@pytest.mark.parametrize("mode", [pytest.param("raise", marks=pytest.mark.slow), "exit"])
def test_failing_rank_ends_the_job_promptly(tmp_path, mode):
    """Rank 1 fails at step 3 (an exception, or an abrupt os._exit); without
    --max-restarts torchrun stops rank 0 and exits non-zero, with the error shown.
    "Promptly" is counted from rank 1's failure to the job's end, so the
    machine's load (imports before the failure) does not count: a rank 0 left
    waiting in a collective would wait out the example's timeout instead."""
    proc, after_failure = _failing_torchrun(tmp_path, "--fail-at-step", "3", "--fail-mode", mode,
                                            failure="rank 1: --fail-at-step 3: exiting",
                                            timeout=240)
    assert proc.returncode != 0
    assert after_failure is not None, proc.stdout
    assert after_failure < 30, after_failure
    # rank 0 may be stopped before it prints step 2 (torchrun kills it as soon
    # as rank 1 is gone), but never trains past the failure
    assert sorted(_losses(proc.stdout)) in ([1], [1, 2])
    assert "rank 1: --fail-at-step 3: exiting" in proc.stdout
    if mode == "raise":
        assert ("[rank 1] failed at step 3: RuntimeError: --fail-at-step 3: simulated failure "
                "on rank 1") in proc.stderr
        assert "Traceback" in proc.stderr
    assert "examples/train_gpt.py FAILED" in proc.stderr  # torchrun's summary
    assert "summary:" not in proc.stdout
    # no orphan: every process whose command line names this run's --out-dir is gone
    orphans = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert orphans.stdout.strip() == "", orphans.stdout


def test_ctrl_c_stops_every_rank_with_a_message(tmp_path):
    """SIGINT to the whole job (what Ctrl-C in a terminal does) during training:
    every process is gone within seconds, a rank says it was interrupted."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "examples/train_gpt.py", *SMALL,
           "--steps", "100000", "--out-dir", str(tmp_path), "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            start_new_session=True)  # its own process group, as in a terminal
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # training has started once a step is printed
            if line.startswith("step 2 loss") or time.monotonic() > deadline:
                break
        assert line.startswith("step 2 loss"), line
        os.killpg(proc.pid, signal.SIGINT)
        start = time.monotonic()
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    assert elapsed < 30, elapsed
    assert re.search(r"\[rank [01]\] interrupted \(Ctrl-C\) at step \d+: exiting", err), err[-3000:]


@pytest.mark.slow  # ~30 s; Muon on owned matrices: tests/core/test_placements.py
def test_muon_on_owned_matrices_trains_like_ddp(tmp_path):
    """``--optimizer muon``: torch's Muon on the blocks' weight matrices,
    each whole on one rank (placement "owned"), AdamW on the rest; DDP runs
    the same optimizers on whole parameters. The same losses (torch's Muon
    orthogonalises in bf16, so last-bit differences in the reduced gradients
    may show: 1e-3), and each rank holds about half of the parameters."""
    proc = _torchrun(tmp_path, "--optimizer", "muon", "--compare", "--no-progress")
    losses = _assert_trained(proc, tmp_path)
    assert "Muon on the block matrices (placement 'owned') + AdamW" in proc.stdout
    rows = {m[0]: m for m in _ROW.findall(proc.stdout)}
    assert list(rows) == ["fsdp_compose", "ddp"], proc.stdout  # FSDP2's DTensors: no Muon
    summary = json.loads((tmp_path / "summary.json").read_text())
    for got, want in zip(summary["runs"][1]["losses"], summary["runs"][0]["losses"], strict=True):
        assert got == pytest.approx(want, abs=1e-3)
    total, here = re.search(r"([\d.]+)M parameters, ([\d.]+)M on this rank", proc.stdout).groups()
    assert 0.3 < float(here) / float(total) < 0.7, proc.stdout
    assert losses[STEPS] < losses[1]


@pytest.mark.slow  # ~55 s; async saves: tests/checkpoint/test_checkpoint_async.py
def test_async_checkpoints_resume_exactly(compare, tmp_path):
    """``--async-save``: checkpoints at steps 2 and 4 written in the background
    (the job waits for the last before it ends), then a resume from step 4
    trains steps 5-6 to the same losses as the uninterrupted run."""
    ckpt = str(tmp_path / "ckpt")
    first = _torchrun(tmp_path / "first", "--batch-per-rank", "4", "--steps", "4",
                      "--save-every", "2", "--ckpt-dir", ckpt, "--async-save", "--no-progress")
    assert "saving " in first.stdout and " in the background" in first.stdout
    assert sorted(p.name for p in Path(ckpt).iterdir() if p.name.startswith("step_")) == \
        ["step_00000002", "step_00000004"]  # both committed before the job ended
    second = _torchrun(tmp_path / "second", "--batch-per-rank", "4", "--ckpt-dir", ckpt,
                       "--resume", "--async-save", "--no-progress")
    resumed = _losses(second.stdout)
    assert sorted(resumed) == [5, 6], second.stdout
    baseline = _losses(compare[0].stdout)
    for step in (5, 6):
        assert resumed[step] == baseline[step], (step, resumed[step], baseline[step])
