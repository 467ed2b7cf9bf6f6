"""A collective call of fsdp_compose made on some ranks only ends, within
seconds, in an error naming the call and the ranks that did not make it
(never in the process group's timeout or a backend error), on the ranks
that made it ([Note: call rendezvous] in ``fsdp_compose/comm/rendezvous.py``).

Run: ``PYTHONPATH=. python -m pytest -q tests/checks/test_calls_on_some_ranks.py``
(gloo on CPU, 2 ranks; the wait is shortened to 0.5 s through
``FSDP_COMPOSE_CALL_TIMEOUT``, set once the ranks have built and trained the
model, so only the call under test meets with it).
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
WAIT = 0.5


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
    model = _prepare(name)
    dist.barrier()  # both ranks ready: the short wait below is the call's alone
    os.environ[CALL_TIMEOUT_ENV] = str(WAIT)
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
    model = _trained()
    dist.barrier()
    os.environ[CALL_TIMEOUT_ENV] = str(WAIT)
    try:
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


def _one_rank_call_while_the_other_trains(name: str):
    """Both ranks train; at step 2 rank 0 alone calls ``name``, then goes on.
    Returns (step, seconds, error type, message) of this rank's error, or None."""
    from tests._training import shard_on_a_new_group
    from tests.checks.test_forward_agreement import Unequal
    torch.manual_seed(0)
    model = Unequal()
    group = shard_on_a_new_group(model, 50, 4.0)  # pending collectives die with it
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        start = time.perf_counter()
        try:
            model(torch.randn(4, 8)).sum().backward()
            if dist.get_rank() == 0 and step == 2:
                if name == "state_dict":
                    model.state_dict()["embed.weight"].full_tensor()
                else:
                    fsdp_compose.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            optim.zero_grad()
        except RuntimeError as error:
            return step, time.perf_counter() - start, type(error).__name__, str(error)
    dist.destroy_process_group(group)
    return None


@pytest.mark.parametrize("name", ["state_dict", "clip_grad_norm_"])
def test_a_call_on_one_rank_while_the_others_train_raises_on_every_rank(name):
    """Rank 0 waits at the call; rank 1 reaches its next forward's agreement
    and waits there: each sees the other waiting at another meeting, so both
    raise at once (no hang, no backend error)."""
    first, second = run_distributed(2, _one_rank_call_while_the_other_trains, name, timeout=90)
    assert first is not None and second is not None, (first, second)
    assert first[0] == 2 and first[1] < 30 and first[2] == "CallMismatchError", first
    assert "rank 1 waits at the forward agreement of root forward #4 instead" in first[3], first
    assert second[0] == 3 and second[1] < 30, second
    assert second[3].startswith("[rank 1] fully_shard ranks diverged: this rank starts root "
                                "forward #4 while other ranks wait at a collective call"), second
    assert "rank 0 waits at" in second[3], second


def _late_rank(seconds: float):
    """Every rank calls clip_grad_norm_; rank 0 first evaluates for
    ``seconds`` (longer than a poll, shorter than the call's timeout).
    Returns what this rank printed to stderr while waiting."""
    import contextlib
    import io

    from fsdp_compose.comm import rendezvous
    os.environ[CALL_TIMEOUT_ENV] = str(seconds + 30)
    notice, rendezvous.LATE_NOTICE_SECONDS = rendezvous.LATE_NOTICE_SECONDS, 1.0
    err = io.StringIO()
    try:
        model = _trained()
        if dist.get_rank() == 0:
            time.sleep(seconds)
        with contextlib.redirect_stderr(err):
            fsdp_compose.clip_grad_norm_(model.parameters(), 1.0)
    finally:
        rendezvous.LATE_NOTICE_SECONDS = notice
        del os.environ[CALL_TIMEOUT_ENV]
    return err.getvalue()


def test_a_late_rank_is_waited_for_with_a_notice_not_an_error():
    printed = run_distributed(2, _late_rank, 3.5, timeout=TIMEOUT)
    assert printed[0] == "", printed[0]
    assert "[rank 1] fsdp_compose: fsdp_compose.clip_grad_norm_ waits for ranks [0], which " \
           "have not reached any collective call of fsdp_compose yet" in printed[1], printed[1]
