"""A collective call of fsdp_compose that waits for a rank blocked in a
collective (FSDP2's ``if rank == 0: torch.save(model.state_dict(), f)``
then ``dist.barrier()``) raises within seconds, naming the call and where
the other rank is blocked; a rank that is only late (user code) is waited
for, with no false alarm ([Note: blocked is not late] in
``fsdp_compose/comm/whereabouts.py``).

Run: ``PYTHONPATH=. python -m pytest -q tests/checks/test_blocked_rank.py``
(gloo on CPU, 2 ranks, under the test harness and under torchrun,
``tests/_blocked_torchrun.py``; the poll is shortened to 0.5 s through
``FSDP_COMPOSE_POLL_SECONDS``, the call timeout stays 1800 s).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compose import fully_shard
from fsdp_compose.comm import rendezvous
from fsdp_compose.comm.rendezvous import POLL_ENV, CallMismatchError
from tests._torchrun_env import run_like_torchrun

ROOT = Path(__file__).resolve().parents[2]
POLL = "0.5"
NAMED_WITHIN = 60.0  # seconds from the mistake to the error, and from the error to the job's end


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 15), nn.Tanh(), nn.Linear(15, 3))
    fully_shard(model[0])
    fully_shard(model)
    model(torch.randn(4, 7)).sum().backward()
    return model


def _save_on_rank_zero(case: str, path: str):
    """Rank 0 saves alone (``case`` a or b) while rank 1 goes to the
    barrier. Rank 0 catches the error and then joins the barrier (it issued
    no collective: the pool lives on). Returns (seconds, message) on rank 0."""
    os.environ[POLL_ENV] = POLL
    model = _model()
    result = None
    try:
        if dist.get_rank() == 0:
            start = time.perf_counter()
            try:
                if case == "a":
                    torch.save(model.state_dict(), path)
                else:
                    torch.save(_every_rank_state_dict(model), path)
            except CallMismatchError as error:
                result = (time.perf_counter() - start, str(error))
        elif case == "b":
            _every_rank_state_dict(model)
    finally:
        del os.environ[POLL_ENV]
    dist.barrier()  # BARRIER: rank 1 is blocked here
    return result


def _every_rank_state_dict(model: nn.Module) -> dict:
    return model.state_dict()  # lazy values: nothing exchanged yet


BARRIER_LINE = next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                    if line.endswith("# BARRIER: rank 1 is blocked here"))


@pytest.mark.parametrize("case, call", [("a", "state_dict() (converting unit <root>"),
                                        ("b", "state_dict() value (0.weight) first used")])
def test_a_save_on_rank_zero_names_the_barrier_of_rank_one(distributed, tmp_path, case, call):
    results = distributed.run(2, _save_on_rank_zero, case, str(tmp_path / "m.pt"), timeout=120)
    assert results[1] is None
    assert results[0] is not None, "rank 0 did not raise"
    seconds, message = results[0]
    print(f"case {case}: rank 0 raised {seconds:.1f} s after the mistake")
    assert seconds < NAMED_WITHIN, message
    assert message.startswith(f"[rank 0] {call}"), message
    assert (f"rank 1 is blocked in torch.distributed.barrier() at "
            f"tests/checks/test_blocked_rank.py:{BARRIER_LINE}, which waits for this rank") in message, \
        message
    assert "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, " \
           "cpu_offload=True))" in message, message
    assert "torch.distributed.checkpoint.save(" in message, message


def _late(seconds: float):
    """Rank 0 evaluates for ``seconds`` (user code), then every rank takes
    the state dict. Returns what this rank printed to stderr."""
    os.environ[POLL_ENV] = POLL
    notice, rendezvous.LATE_NOTICE_SECONDS = rendezvous.LATE_NOTICE_SECONDS, 2.0
    err = io.StringIO()
    try:
        model = _model()
        if dist.get_rank() == 0:
            _evaluate(seconds)
        with contextlib.redirect_stderr(err):
            {k: v.full_tensor() for k, v in model.state_dict().items()}
    finally:
        rendezvous.LATE_NOTICE_SECONDS = notice
        del os.environ[POLL_ENV]
    return err.getvalue()


def _evaluate(seconds: float) -> None:
    time.sleep(seconds)  # EVALUATION


EVALUATION_LINE = next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                       if line.endswith("# EVALUATION"))


def test_a_late_rank_gets_no_false_alarm_and_the_notice_says_what_it_does(distributed):
    printed = distributed.run(2, _late, 8.0, timeout=120)
    assert printed[0] == "", printed[0]
    assert "[rank 1] fsdp_compose: state_dict() (converting unit <root>" in printed[1], printed[1]
    assert f"rank 0 runs _evaluate() at tests/checks/test_blocked_rank.py:{EVALUATION_LINE}" in \
        printed[1], printed[1]


# ------------------------------------------------------- the forward agreement
def _forward_while_blocked(blocked_in: str):
    """Rank 1 enters a torch collective (``blocked_in``) while rank 0 starts
    a forward; rank 0 catches the error, then joins that collective (it
    issued nothing else: the pool lives on). Returns (seconds, message) on rank 0."""
    os.environ[POLL_ENV] = POLL
    model = _model()
    result = None
    try:
        if dist.get_rank() == 0:
            start = time.perf_counter()
            try:
                model(torch.randn(4, 7)).sum().backward()
            except RuntimeError as error:
                result = (time.perf_counter() - start, str(error))
    finally:
        del os.environ[POLL_ENV]
    if blocked_in == "barrier":
        dist.barrier()  # FORWARD BARRIER: rank 1 is blocked here
    else:
        dist.all_reduce(torch.ones(3))  # FORWARD ALL-REDUCE: rank 1 is blocked here
    return result


def _line_ending(text: str) -> int:
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                if line.endswith(text))


@pytest.mark.parametrize("blocked_in, call", [
    ("barrier", "torch.distributed.barrier()"), ("all_reduce", "torch.distributed.all_reduce()")])
def test_a_forward_names_a_rank_blocked_in_a_torch_collective(distributed, blocked_in, call):
    results = distributed.run(2, _forward_while_blocked, blocked_in, timeout=120)
    assert results[1] is None
    assert results[0] is not None, "rank 0 did not raise"
    seconds, message = results[0]
    print(f"{blocked_in}: rank 0 raised {seconds:.1f} s after starting its forward")
    assert seconds < NAMED_WITHIN, message
    line = _line_ending("# FORWARD BARRIER: rank 1 is blocked here" if blocked_in == "barrier"
                        else "# FORWARD ALL-REDUCE: rank 1 is blocked here")
    assert message.startswith("[rank 0] fully_shard ranks diverged: this rank starts root "
                              "forward #2 while other ranks are blocked"), message
    assert f"rank 1 is blocked in {call} at tests/checks/test_blocked_rank.py:{line}, which waits " \
           "for this rank" in message, message
    assert "on every rank" in message, message


def _late_forward(seconds: float):
    """Rank 1 evaluates for ``seconds`` (user code) while rank 0 starts a
    forward; then rank 1 runs it too. Returns the loss on every rank."""
    os.environ[POLL_ENV] = POLL
    try:
        model = _model()
        if dist.get_rank() == 1:
            _evaluate(seconds)
        loss = model(torch.randn(4, 7)).sum()
        loss.backward()
    finally:
        del os.environ[POLL_ENV]
    return loss.item()


def test_a_forward_waits_for_a_late_rank_without_a_false_alarm(distributed):
    losses = distributed.run(2, _late_forward, 5.0, timeout=120)
    assert all(isinstance(loss, float) for loss in losses), losses


# ------------------------------------------------------------------ torchrun
def _torchrun(tmp_path: Path, case: str) -> tuple[subprocess.CompletedProcess, float]:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", POLL_ENV: POLL}
    env.pop("FSDP_COMPOSE_CALL_TIMEOUT", None)  # the default, 1800 s
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "tests" / "_blocked_torchrun.py"), case,
                           str(tmp_path / "m.pt")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    return proc, time.time()


def _stamp(out: str, rank: int, what: str) -> float:
    found = re.search(rf"^RANK {rank} {what} (\S+)", out, re.M)
    assert found, f"no {what} of rank {rank}:\n{out}"
    return float(found.group(1))


@pytest.mark.parametrize("case", ["a", "b"])
def test_under_torchrun_the_mistake_is_named_and_the_job_ends_within_a_minute(tmp_path, case):
    """Case a under torchrun itself: its agent ending the job (rank 1 stays blocked
    in the barrier) is part of what is checked. Case b names another mistake the same
    way; its ranks are started as torchrun starts them (tests/_torchrun_env.py),
    whose launcher kills rank 1 once rank 0 has failed, as the agent does."""
    if case == "a":
        proc, ended = _torchrun(tmp_path, case)
    else:
        proc = run_like_torchrun(2, "tests/_blocked_torchrun.py", case, str(tmp_path / "m.pt"),
                                 cwd=ROOT, timeout=240,
                                 env={POLL_ENV: POLL, "FSDP_COMPOSE_CALL_TIMEOUT": None})
        ended = time.time()
    out = proc.stdout
    assert proc.returncode != 0, out
    mistake = _stamp(out, 0, "MISTAKE")
    error = _stamp(out, 0, "ERROR")
    print(f"case {case}: error {error - mistake:.1f} s after the mistake, "
          f"job end {ended - error:.1f} s after the error")
    assert error - mistake < NAMED_WITHIN and ended - error < NAMED_WITHIN
    assert re.search(r"^RANK 0 ERROR \S+ CallMismatchError: \[rank 0\] state_dict\(\) .* but rank 1 "
                     r"is blocked in torch\.distributed\.barrier\(\) at "
                     r"\S*_blocked_torchrun\.py:\d+, which waits for this rank", out, re.M), out


def test_under_torchrun_a_late_rank_is_waited_for(tmp_path):
    """Nothing of torchrun's agent is at stake here (no rank fails): the ranks are
    started as torchrun starts them (tests/_torchrun_env.py), forked, not launched."""
    proc = run_like_torchrun(2, "tests/_blocked_torchrun.py", "late", str(tmp_path / "m.pt"),
                             cwd=ROOT, timeout=240,
                             env={POLL_ENV: POLL, "FSDP_COMPOSE_CALL_TIMEOUT": None})
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "RANK 0 DONE" in proc.stdout and "RANK 1 DONE" in proc.stdout, proc.stdout


def _sleeps(thread_id: int) -> int:
    """How many times the thread has given up the CPU of its own accord."""
    with open(f"/proc/self/task/{thread_id}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt"))


@pytest.mark.parametrize("kind", ["file", "hash"])
def test_the_watcher_answers_and_looks_at_a_file_store_twice_a_second(tmp_path, kind):
    """Jobs started with ``init_method="file://..."`` (a file on a shared file
    system, some clusters' way) have a ``FileStore``, whose blocking ``wait``
    re-reads the file every 10 ms: the watcher looks for a question every
    ``FILE_STORE_POLL`` s there instead (its thread's sleeps counted over a
    second: about a hundred with ``wait``), and answers all the same."""
    from fsdp_compose.comm import whereabouts
    base = dist.FileStore(str(tmp_path / "store"), 1) if kind == "file" else dist.HashStore()
    store = dist.PrefixStore("job", base)
    assert whereabouts.is_file_store(store) == (kind == "file")
    watcher = whereabouts._Watcher(store, 0)
    watcher.thread.start()
    prefix = f"{whereabouts._PREFIX}/0"
    try:
        deadline, said = time.monotonic() + 60, None
        while said is None and time.monotonic() < deadline:  # asked again, as a waiting rank
            number = store.add(f"{prefix}/asked", 1)  # does: a question asked before the
            store.set(f"{prefix}/ask/{number}", "1")  # watcher started is not answered
            with contextlib.suppress(RuntimeError):  # wait's timeout
                store.wait([f"{prefix}/said/{number}"], timedelta(seconds=2))
                said = json.loads(store.get(f"{prefix}/said/{number}"))
        assert said is not None and said[0] == "code", said  # the main thread: in this test
        if kind == "file":
            before = _sleeps(watcher.thread.native_id)
            time.sleep(1.0)
            sleeps = _sleeps(watcher.thread.native_id) - before
            assert sleeps <= 4 * (1.0 / whereabouts.FILE_STORE_POLL + 1), sleeps
    finally:
        watcher.stop()
    assert not watcher.thread.is_alive()
