"""A collective call of fsdp_compose made on some ranks only ends, within
seconds, in an error naming the call and the ranks that did not make it
(never in the process group's timeout or a backend error), on the ranks
that made it ([Note: call rendezvous] in ``fsdp_compose/comm/rendezvous.py``).

Run: ``PYTHONPATH=. python -m pytest -q tests/test_one_rank_calls.py``
(gloo on CPU, 2 ranks; the wait is shortened to 2 s through
``FSDP_COMPOSE_CALL_TIMEOUT``).
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_compose
from fsdp_compose import fully_shard
from fsdp_compose.checkpoint import CheckpointStore, scatter_full_state_dict
from fsdp_compose.comm.rendezvous import CALL_TIMEOUT_ENV, CallMismatchError
from tests.harness import run_distributed

TIMEOUT = 60
WAIT = 2.0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 15)
        self.b = nn.Linear(15, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        model = _Net()
    fully_shard(model.a)
    fully_shard(model)
    return model


def _trained() -> nn.Module:
    model = _model()
    model(torch.randn(4, 7)).sum().backward()
    return model


def _prepare(name: str) -> nn.Module:
    """Every rank: the model the call is made on."""
    if name == "materialize":
        return _model("meta")
    if name in ("unshard", "scatter_full_state_dict"):
        return _model()
    model = _trained()
    model.optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.optim.step()  # per-element state (momentum) to convert
    if name == "optimizer.load_state_dict":
        model.saved = model.optim.state_dict()  # on every rank
    return model


def _call(name: str, model: nn.Module, directory: str) -> None:
    """Make the collective call ``name`` (on this rank only)."""
    if name == "state_dict":
        model.state_dict()
    elif name == "load_state_dict":
        model.load_state_dict({k: torch.zeros(v.shape) for k, v in _Net().state_dict().items()})
    elif name == "clip_grad_norm_":  # after the first backward: a verified iteration
        fsdp_compose.clip_grad_norm_(model.parameters(), 1.0)
    elif name == "param_norms":
        fsdp_compose.param_norms(model, kind="weight")
    elif name == "unshard":
        model.unshard()
    elif name == "materialize":
        fsdp_compose.materialize(model)
    elif name == "scatter_full_state_dict":
        scatter_full_state_dict(model, _Net().state_dict())
    elif name == "optimizer.state_dict":
        model.optim.state_dict()
    elif name == "optimizer.load_state_dict":
        model.optim.load_state_dict(model.saved)
    elif name == "CheckpointStore.save":
        CheckpointStore(directory).save(1, {"model": model})
    else:
        raise AssertionError(name)


def _on_rank_zero_only(name: str):
    """Rank 0 makes the call; rank 1 does not. Returns (seconds, message)
    of rank 0's error, or None."""
    os.environ[CALL_TIMEOUT_ENV] = str(WAIT)
    model = _prepare(name)
    result = None
    try:
        if dist.get_rank() == 0:
            with tempfile.TemporaryDirectory() as directory:
                start = time.perf_counter()
                try:
                    _call(name, model, directory)
                except CallMismatchError as error:
                    result = (time.perf_counter() - start, str(error))
    finally:
        del os.environ[CALL_TIMEOUT_ENV]
    dist.barrier()  # rank 1 waits here while rank 0 waits for it at the store
    return result


CALLS = {
    "state_dict": "state_dict() (converting unit <root>",
    "load_state_dict": "load_state_dict() (converting unit <root>",
    "clip_grad_norm_": "fsdp_compose.clip_grad_norm_",
    "param_norms": "fsdp_compose.param_norms",
    "unshard": "unshard() of",
    "materialize": "fsdp_compose.materialize",
    "scatter_full_state_dict": "fsdp_compose.scatter_full_state_dict",
    "CheckpointStore.save": "CheckpointStore.save",
    "optimizer.state_dict": "optimizer.state_dict()",
    "optimizer.load_state_dict": "optimizer.load_state_dict()",
}


@pytest.mark.parametrize("name", list(CALLS))
def test_a_call_on_one_rank_names_the_call_and_the_missing_ranks(name):
    results = run_distributed(2, _on_rank_zero_only, name, timeout=TIMEOUT)
    assert results[1] is None
    assert results[0] is not None, f"{name} on rank 0 only did not raise CallMismatchError"
    seconds, message = results[0]
    assert seconds < WAIT + 5, f"took {seconds:.1f} s"
    assert message.startswith(f"[rank 0] {CALLS[name]}"), message
    assert f"ranks [1] did not call it within {WAIT:g} s" in message, message
    assert "Nothing was communicated" in message


def _different_calls():
    os.environ[CALL_TIMEOUT_ENV] = str(WAIT)
    try:
        model = _trained()
        if dist.get_rank() == 0:
            fsdp_compose.param_norms(model, kind="weight")
        else:
            fsdp_compose.clip_grad_norm_(model.parameters(), 1.0)
    except CallMismatchError as error:
        return str(error)
    finally:
        del os.environ[CALL_TIMEOUT_ENV]
    return None


def test_different_calls_on_two_ranks_name_each_other():
    messages = run_distributed(2, _different_calls, timeout=TIMEOUT)
    assert "rank 1 called fsdp_compose.clip_grad_norm_ there instead" in messages[0], messages[0]
    assert "rank 0 called fsdp_compose.param_norms there instead" in messages[1], messages[1]
