"""``CheckpointStore(..., async_save=True)``: ``save`` returns after staging,
the background thread writes and commits; the store's crash-safety holds.

* what is written is the state at the ``save`` call, although training
  changes the parameters and optimizer state while the thread writes (torch's
  recipe and the zero-copy ``flat_state_dict`` alike);
* a rank killed while a save is in flight leaves that save uncommitted and
  the previous checkpoint the newest, loadable one.

Run: PYTHONPATH=$PWD python -m pytest -q tests/checkpoint/test_checkpoint_async.py
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_compose.checkpoint import CheckpointStore, flat_state_dict
from tests.harness import WorkerDiedError, run_distributed
from tests.checkpoint.test_checkpoint_store import _App, _app, _full_params, _train

TIMEOUT = 90


class _FlatApp(_App):
    """The same application state through the zero-copy path."""

    def state_dict(self) -> dict[str, Any]:
        msd, osd = flat_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd, "step": self.step}


def _snapshot(app: _App) -> list[torch.Tensor]:
    return [t.clone() for t in _full_params(app)]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def async_saves(root: str, flat: bool) -> dict[str, Any]:
    kind = _FlatApp if flat else _App
    store = CheckpointStore(root, keep=2, async_save=True)
    app = _app()
    app.__class__ = kind
    _train(app, 1)
    store.save(1, {"app": app})
    want1 = _snapshot(app)
    _train(app, 1)  # while step 1 is being written: must not reach its files
    store.save(2, {"app": app})
    want2 = _snapshot(app)
    _train(app, 1)
    final = _snapshot(app)
    store.wait()
    out = {"steps": store.steps(), "manifest": (Path(root) / "latest").read_text()}
    for step, want in ((1, want1), (2, want2)):
        fresh = _app(seed=1)
        fresh.__class__ = kind
        store.load(step, {"app": fresh})
        out[f"loaded {step}"] = _equal(_snapshot(fresh), want) and fresh.step == step
    _train(fresh, 1)  # optimizer state of step 2 came back: step 3 agrees with the original's
    out["continued"] = _equal(_snapshot(fresh), final)
    return out


@pytest.mark.parametrize("flat", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["dtensor", "flat"])
def test_async_save_writes_the_state_at_the_call(tmp_path, flat):
    for rank, out in enumerate(run_distributed(2, async_saves, str(tmp_path), flat,
                                               timeout=TIMEOUT)):
        assert out["steps"] == [1, 2] and out["manifest"] == "2\n", out
        assert out["loaded 1"] and out["loaded 2"] and out["continued"], (rank, out)


def killed_mid_save(root: str) -> None:
    store = CheckpointStore(root, keep=2, async_save=True)
    app = _app()
    _train(app, 1)
    store.save(1, {"app": app})
    store.wait()
    want = _snapshot(app)  # collective
    if dist.get_rank() == 0:
        torch.save(want, os.path.join(root, "want.pt"))
    _train(app, 1)
    store.save(2, {"app": app})
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # its background write is in flight
    store.wait()  # rank 0: raises (its peer is gone) or is killed by the harness


def load_latest_after_crash(root: str) -> dict[str, Any]:
    store = CheckpointStore(root)
    fresh = _app(seed=1)
    step = store.load_latest({"app": fresh})
    want = torch.load(os.path.join(root, "want.pt"))
    return {"step": step, "equal": _equal(_snapshot(fresh), want)}


def test_rank_killed_during_async_save_keeps_the_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    with pytest.raises(WorkerDiedError):
        run_distributed(2, killed_mid_save, root, timeout=TIMEOUT)
    store = CheckpointStore(root)
    assert store.steps() == [1], sorted(os.listdir(root))
    assert (tmp_path / "latest").read_text() == "1\n"
    for res in run_distributed(2, load_latest_after_crash, root, timeout=TIMEOUT):
        assert res == {"step": 1, "equal": True}, res
