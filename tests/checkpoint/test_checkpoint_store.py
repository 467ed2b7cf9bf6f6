"""``fsdp_compose.checkpoint.CheckpointStore``: atomic, rotating DCP checkpoint
directories, and exact resume of ``examples/train_gpt.py`` under torchrun.

The unit tests run on 2 gloo ranks (``tests.harness``) and save annotated
models with their optimizers through ``get_state_dict``/``set_state_dict``;
the end-to-end tests start ``torchrun`` and compare per-step losses (printed
as exact floats) and the final checkpoints of resumed and uninterrupted runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_compose import fully_shard
from fsdp_compose.checkpoint import CheckpointError, CheckpointStore
from tests.harness import run_distributed

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ helpers (run on every rank)
class _App(Stateful):
    """Model + optimizer + a step counter, as one DCP ``Stateful``."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim, self.step = model, optim, 0

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd, "step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
        self.step = int(sd["step"])


def _app(out_features: int = 9, seed: int = 0) -> _App:
    """An annotated two-unit MLP (uneven sizes) and its AdamW."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 11), nn.Tanh(), nn.Linear(11, out_features))
    fully_shard(model[0])
    fully_shard(model)
    return _App(model, torch.optim.AdamW(model.parameters(), lr=0.01))


def _train(app: _App, steps: int) -> None:
    rank = dist.get_rank()
    for _ in range(steps):
        app.step += 1
        g = torch.Generator().manual_seed(100 * app.step + rank)
        app.model(torch.randn(4, 5, generator=g)).square().mean().backward()
        app.optim.step()
        app.optim.zero_grad()


def _full_params(app: _App) -> list[torch.Tensor]:
    return [v.full_tensor() for v in app.model.state_dict().values()]


def _same(a: _App, b: _App) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_full_params(a), _full_params(b), strict=True))


def _keep_one(root: str) -> dict[str, Any]:
    store = CheckpointStore(root, keep=1)
    app = _app()
    empty = store.load_latest({"app": app})  # nothing saved yet: None, nothing touched
    _train(app, 2)
    store.save(2, {"app": app})
    after_first = sorted(os.listdir(root))
    _train(app, 2)
    path = store.save(4, {"app": app})
    after_second = sorted(os.listdir(root))
    fresh = _app(seed=1)  # other initial values: the load must overwrite them all
    step = store.load_latest({"app": fresh})
    loaded_equal = _same(app, fresh)
    _train(app, 2)  # the optimizer state came back too: training continues identically
    _train(fresh, 2)
    return {"empty": empty, "after_first": after_first, "after_second": after_second,
            "path": str(path), "step": step, "fresh_step": fresh.step - 2,
            "loaded_equal": loaded_equal, "continued_equal": _same(app, fresh),
            "manifest": (Path(root) / "latest").read_text(), "latest_step": store.latest_step()}


def _stale_partial(root: str) -> dict[str, Any]:
    store = CheckpointStore(root, keep=2)
    app = _app()
    _train(app, 2)
    store.save(2, {"app": app})
    _train(app, 1)
    store.save(3, {"app": app})
    if dist.get_rank() == 0:
        # What a crash leaves: a newer save whose rename never happened. Even a
        # complete copy (with .metadata) under a .partial name is never loaded.
        shutil.copytree(Path(root) / "step_00000003", Path(root) / "step_00000009.partial-dead")
        (Path(root) / "step_00000010.partial-beef").mkdir()
        (Path(root) / "latest.tmp-0123").write_text("10\n")
    dist.barrier()
    fresh = _app(seed=1)
    step = store.load_latest({"app": fresh})
    loaded_equal = _same(app, fresh)
    before = sorted(os.listdir(root))
    _train(fresh, 1)
    store.save(4, {"app": fresh})
    return {"step": step, "loaded_equal": loaded_equal, "before": before,
            "after": sorted(os.listdir(root)), "steps": store.steps()}


def _expect_load_error(root: str, model_out: int) -> str:
    store = CheckpointStore(root)
    try:
        store.load_latest({"app": _app(out_features=model_out)})
    except CheckpointError as e:
        dist.barrier()  # every rank raised: none is stuck in a collective
        return str(e)
    raise AssertionError("load_latest did not raise")


def _save_then_tear(root: str, what: str) -> str:
    store = CheckpointStore(root)
    app = _app()
    _train(app, 1)
    store.save(1, {"app": app})
    _train(app, 1)
    path = store.save(2, {"app": app})
    if dist.get_rank() == 0:
        if what == "metadata":
            (path / ".metadata").unlink()
        else:  # rank 1's data file
            (path / "__1_0.distcp").unlink()
    dist.barrier()
    return _expect_load_error(root, 9)


def _save_then_load_other_shape(root: str) -> str:
    store = CheckpointStore(root)
    app = _app(out_features=9)
    _train(app, 1)
    store.save(1, {"app": app})
    return _expect_load_error(root, 6)


def _commit_fails_on_rank0(root: str) -> dict[str, Any]:
    store = CheckpointStore(root)
    app = _app()
    _train(app, 1)
    store.save(1, {"app": app})
    _train(app, 1)
    if dist.get_rank() == 0:
        def fail(*args: Any) -> None:
            raise OSError("disk full (simulated)")
        store._commit = fail  # type: ignore[method-assign]
    try:
        store.save(2, {"app": app})
    except CheckpointError as e:
        message = str(e)
    else:
        raise AssertionError("save did not raise")
    fresh = _app(seed=1)
    return {"message": message, "listing": sorted(os.listdir(root)),
            "loaded": store.load_latest({"app": fresh}), "step": fresh.step}


# ------------------------------------------------------------------ unit tests
def test_keep_one_leaves_only_the_newest_and_loads_it(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_distributed(2, _keep_one, root)
    for r in results:
        assert r["empty"] is None
        assert r["after_first"] == ["latest", "step_00000002"]
        assert r["after_second"] == ["latest", "step_00000004"]
        assert r["path"] == os.path.join(root, "step_00000004")
        assert r["step"] == 4 and r["fresh_step"] == 4
        assert r["loaded_equal"] and r["continued_equal"]
        assert r["manifest"] == "4\n" and r["latest_step"] == 4
    assert os.path.isfile(os.path.join(root, "step_00000004", ".metadata"))


def test_stale_partial_is_ignored_then_cleaned(tmp_path):
    root = str(tmp_path / "ckpt")
    for r in run_distributed(2, _stale_partial, root):
        assert r["step"] == 3 and r["loaded_equal"]
        assert "step_00000009.partial-dead" in r["before"]
        assert r["after"] == ["latest", "step_00000003", "step_00000004"]  # keep=2, garbage gone
        assert r["steps"] == [3, 4]


@pytest.mark.parametrize("case, step, fragments", [
    ("no-metadata", "step_00000002", [".metadata", "torn"]),
    ("no-data-file", "step_00000002", ["__1_0.distcp"]),
    ("other-model-shape", "step_00000001", ["could not be loaded", "Size mismatch"]),
])
def test_bad_checkpoint_raises_the_same_error_on_every_rank(tmp_path, case, step, fragments):
    """A torn checkpoint (no ``.metadata``, a data file missing) or one of a
    model with other shapes: every rank raises one message naming the
    checkpoint directory and what is wrong."""
    root = str(tmp_path / "ckpt")
    if case == "other-model-shape":
        messages = run_distributed(2, _save_then_load_other_shape, root)
    else:
        messages = run_distributed(2, _save_then_tear, root,
                                   "metadata" if case == "no-metadata" else "data")
    for msg in messages:
        assert os.path.join(root, step) in msg
        for fragment in fragments:
            assert fragment in msg, (fragment, msg)
    assert messages[0] == messages[1]


def test_failed_commit_raises_on_every_rank_and_keeps_the_previous(tmp_path):
    root = str(tmp_path / "ckpt")
    for r in run_distributed(2, _commit_fails_on_rank0, root):
        assert os.path.join(root, "step_00000002") in r["message"]
        assert "not committed" in r["message"] and "disk full (simulated)" in r["message"]
        assert r["listing"][:2] == ["latest", "step_00000001"] and len(r["listing"]) == 3
        assert r["listing"][2].startswith("step_00000002.partial-")
        assert r["loaded"] == 1 and r["step"] == 1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_single_process_without_process_group(tmp_path):
    """No process group: everything is local (dcp runs without collectives)."""
    assert not dist.is_initialized()
    store = CheckpointStore(tmp_path, keep=2)
    assert store.latest_step() is None and store.load_latest({"x": {"t": torch.zeros(3)}}) is None
    for step in (1, 2, 3):
        store.save(step, {"x": {"t": torch.full((3,), float(step))}})
    store.save(3, {"x": {"t": torch.full((3,), 7.0)}})  # the same step again replaces it
    assert store.steps() == [2, 3] and sorted(os.listdir(tmp_path)) == [
        "latest", "step_00000002", "step_00000003"]
    state = {"x": {"t": torch.zeros(3)}}
    assert store.load_latest(state) == 3 and torch.equal(state["x"]["t"], torch.full((3,), 7.0))
    store.load(2, state)
    assert torch.equal(state["x"]["t"], torch.full((3,), 2.0))
    with pytest.raises(CheckpointError, match="step_00000001.*does not exist"):
        store.load(1, state)
    with pytest.raises(ValueError):
        CheckpointStore(tmp_path, keep=0)


# ------------------------------------------------------------------ end to end (torchrun)
SMALL = ["--layers", "2", "--width", "32", "--heads", "2", "--vocab", "97", "--seq", "16",
         "--batch-per-rank", "2", "--warmup", "2", "--min-lr-ratio", "0.1", "--decay-steps", "8"]
_LOSS = re.compile(r"^step (\d+) loss (\S+)$", re.MULTILINE)


def _train_gpt(*args: str, restarts: int = 0) -> tuple[dict[int, float], str]:
    """Run examples/train_gpt.py on 2 ranks; return {step: loss} (last print wins) and stdout.

    torchrun shares one store across restarts; ``init_from_torchrun`` gives
    every attempt its own key prefix (without it a restarted rank can read its
    dead peer's gloo address: "connectFullMesh failed ... Connection refused")."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out_dir = tempfile.mkdtemp(prefix="train_gpt_out_")  # summary/plot, not under the repo
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", str(restarts),
           "examples/train_gpt.py", *SMALL, "--out-dir", out_dir, "--no-progress", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {int(s): float(v) for s, v in _LOSS.findall(proc.stdout)}, proc.stdout


def _checkpoint_tensors(path: Path, tmp: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = tmp / f"{path.parent.name}-{path.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def _assert_same_checkpoint(a: Path, b: Path, tmp: Path) -> None:
    sa, sb = _checkpoint_tensors(a, tmp), _checkpoint_tensors(b, tmp)
    flat_a, flat_b = _flatten(sa), _flatten(sb)
    assert flat_a.keys() == flat_b.keys()
    for key, value in flat_a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, flat_b[key]), key
        else:
            assert value == flat_b[key], key


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        return {k: v for key, sub in obj.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): obj}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict[int, float], Path]:
    """8 steps in one go, saving every 2 steps (shared by the resume tests)."""
    ckpt = tmp_path_factory.mktemp("uninterrupted") / "ckpt"
    losses, _ = _train_gpt("--steps", "8", "--ckpt-dir", str(ckpt), "--save-every", "2")
    assert sorted(losses) == list(range(1, 9))
    return losses, ckpt


@pytest.mark.slow
def test_killed_rank_restart_resumes_exactly(tmp_path, uninterrupted):
    """Rank 1 dies at the start of step 5; torchrun restarts both ranks, which resume
    from the step-4 checkpoint and reproduce the uninterrupted run bit for bit."""
    want, want_ckpt = uninterrupted
    ckpt = tmp_path / "ckpt"
    got, out = _train_gpt("--steps", "8", "--ckpt-dir", str(ckpt), "--save-every", "2",
                          "--resume", "--fail-at-step", "5", restarts=1)
    assert "--fail-at-step 5: exiting" in out
    assert f"resumed from {ckpt / 'step_00000004'} after step 4" in out
    assert got == want  # every step's loss: 1-4 from the first attempt, 5-8 after the restart
    assert sorted(os.listdir(ckpt)) == ["latest", "step_00000006", "step_00000008"]
    _assert_same_checkpoint(ckpt / "step_00000008", want_ckpt / "step_00000008", tmp_path)


@pytest.mark.slow
def test_resume_in_a_second_invocation_continues_exactly(tmp_path, uninterrupted):
    want, want_ckpt = uninterrupted
    ckpt = tmp_path / "ckpt"
    first, out = _train_gpt("--steps", "4", "--ckpt-dir", str(ckpt), "--save-every", "2",
                            "--resume")
    assert "no checkpoint in" in out
    assert first == {s: want[s] for s in range(1, 5)}
    second, out = _train_gpt("--steps", "8", "--ckpt-dir", str(ckpt), "--save-every", "2",
                             "--resume")
    assert f"resumed from {ckpt / 'step_00000004'} after step 4" in out
    assert second == {s: want[s] for s in range(5, 9)}
    _assert_same_checkpoint(ckpt / "step_00000008", want_ckpt / "step_00000008", tmp_path)
