"""Divergence after the verified iterations gets a diagnosis, not a backend
error: when a collective of the step stalls (``FSDP_COMPOSE_STALL_SECONDS``)
or fails, every rank publishes its recent collectives to the rendezvous
store and raises naming the first one where the ranks disagree
([Note: flight log] in ``fsdp_compose/comm/wire.py``).

Run: ``PYTHONPATH=. python -m pytest -q tests/checks/test_flight_log.py``
(gloo on CPU, 2 ranks; ``-m slow`` adds the step-100 case and a torchrun
job, ``tests/_flight_torchrun.py``).

The model's units all have the same size and are not bucketed (a bucket's
collectives have a fixed size: they pair, and the fingerprint names the
divergence at the end of backward, ``tests/runtime/test_bucketing.py``):
collectives of different units then pair without gloo noticing and stall. Where the sizes differ, gloo
aborts the process that receives the larger message (``SIGABRT``, nothing
to catch), and only the other ranks can report (docs/errors.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compose.comm.wire import STALL_ENV
from tests._training import assert_diverged_on_every_rank, shard_on_a_new_group
from tests.harness import run_distributed

STALL = 3


class Uniform(nn.Module):
    """Four same-size units under a root that owns no parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor, skip=None) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = torch.tanh(block(x))
        return x


def _train(steps: int, at_step: int, what: str):
    """Every rank trains ``steps`` steps; at ``at_step`` rank 1 skips
    blocks.2 (``skip``) or only sleeps (``slow``). Returns (step, seconds
    into the step, message) of the error, or None."""
    os.environ[STALL_ENV] = str(STALL)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Uniform()
    # unbucketed: buckets pair and are named at the end of backward
    group = shard_on_a_new_group(model, 50, bucket_cap_mb=0)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    result = None
    try:
        for step in range(steps):
            odd = rank == 1 and step == at_step
            if odd and what == "slow":
                time.sleep(2 * STALL + 1)  # rank 0 stalls twice, then it goes on
            start = time.perf_counter()
            try:
                model(torch.randn(4, 16), 2 if odd and what == "skip" else None).sum().backward()
            except RuntimeError as error:
                result = (step, time.perf_counter() - start, str(error))
                break
            optim.step()
            optim.zero_grad()
    finally:
        del os.environ[STALL_ENV]
    if result is None:
        dist.destroy_process_group(group)
    # else: the group paired mismatched collectives; it cannot be used (or destroyed) cleanly
    return result


def _check_diagnosis(results, at_step: int) -> None:
    """A skipped unit is now named by the agreement at the end of every
    training forward, before any collective could stall (the flight log's
    diagnosis of a stalled step is tested with a forward that has no
    backward on one rank, ``tests/checks/test_forward_agreement.py``)."""
    assert_diverged_on_every_rank(
        results, at_step, f"ran different units in root forward #{at_step + 1}",
        "before the backward communicated anything", "'blocks.2'", "'blocks.3'",
        "cannot fix forward-side divergence")


def test_a_unit_skipped_at_step_5_is_named_on_every_rank():
    _check_diagnosis(run_distributed(2, _train, 8, 5, "skip", timeout=90), 5)


@pytest.mark.slow
def test_a_unit_skipped_at_step_100_is_named_on_every_rank():
    _check_diagnosis(run_distributed(2, _train, 103, 100, "skip", timeout=150), 100)


def test_a_slow_rank_is_not_divergence():
    """Rank 0 stalls while rank 1 sleeps: it publishes its log, finds no
    disagreement (rank 1 published nothing), withdraws it and trains on."""
    assert run_distributed(2, _train, 8, 3, "slow", timeout=90) == [None, None]


@pytest.mark.slow  # one torchrun job, ~20 s
def test_a_unit_skipped_at_step_5_is_named_on_every_rank_under_torchrun():
    root = Path(__file__).resolve().parents[2]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "tests/_flight_torchrun.py", "5"],
        cwd=root, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(root), STALL_ENV: str(STALL)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        found = re.search(rf"^RANK {rank} STEP (\d+) AFTER ([\d.]+) S\n(.*?)\nEND$", proc.stdout,
                          re.MULTILINE | re.DOTALL)
        assert found, f"rank {rank} printed no error:\n{proc.stdout[-3000:]}"
        step, seconds, message = int(found[1]), float(found[2]), found[3]
        assert step == 5 and seconds < 60, (step, seconds)
        assert message.startswith(f"[rank {rank}] fully_shard ranks diverged: the ranks ran "
                                  "different units in root forward #6"), message
        assert "'blocks.2'" in message and "'blocks.3'" in message, message
