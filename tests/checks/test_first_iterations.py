"""The first two training iterations are verified, all of them: divergence
introduced at any phase of iteration 0 or 1 (an evaluation forward before
the training forward, a non-root unit skipped, a unit's backward on some
ranks only, an extra reduction at the end of backward, a collective call at
the optimizer step) raises a named error on every rank within seconds.

Run: ``PYTHONPATH=. python -m pytest -q tests/checks/test_first_iterations.py``
(gloo on CPU, 2 ranks; each world uses a process group with a 20 s
collective timeout, so a missed check shows as a backend error or a
timeout, not as the message).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import fsdp_compose
from fsdp_compose.comm.rendezvous import CALL_TIMEOUT_ENV
from fsdp_compose.checks.divergence import VERIFICATION_FORWARD_LIMIT
from tests._comm_counter import ALL_GATHER, CollectiveCounter
from tests.harness import run_distributed
from tests.checks.test_rank_divergence import _batch, _build, _group, _rank_loss

TIMEOUT = 60
STEPS = 3


def _diverge_at(phase: str, at_step: int):
    """Runs on every rank: train ``STEPS`` steps; at ``at_step`` the ranks
    differ in ``phase``. Returns (step, seconds, message) of the error, or
    None if every step ran."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ[CALL_TIMEOUT_ENV] = "3"
    group = _group()
    model = _build(group)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    result = None
    for step in range(STEPS):
        x, y = _batch(step, world)
        x, y = x[rank::world], y[rank::world]
        odd = step == at_step
        order, aux_ranks = (0, 1, 2), range(world)
        start = time.perf_counter()
        try:
            if odd and phase == "pre-forward" and rank == 0:
                with torch.no_grad():
                    model(x)  # an evaluation on rank 0 only
            if odd and phase == "non-root-forward" and rank == 1:
                order = (0, 2)
            if odd and phase == "backward":
                aux_ranks = (0,)
            if odd and phase == "end-of-backward" and rank == 0:
                model.never.set_reduce_scatter_unused_params(True, recurse=False)
            _rank_loss(model, x, y, rank, aux_ranks, order).backward()
            if odd and phase == "optimizer-step":
                if rank == 1:
                    break  # rank 1 skips the call (and, here, waits in the barrier below)
                fsdp_compose.clip_grad_norm_(model.parameters(), 1.0)
            if phase == "every-rank-evaluates" and odd:
                with torch.no_grad():
                    model(x)
        except RuntimeError as error:
            result = (step, time.perf_counter() - start, str(error))
            break
        optim.step()
        optim.zero_grad()
    dist.barrier(group)
    dist.destroy_process_group(group)
    del os.environ[CALL_TIMEOUT_ENV]
    return result


PHASES = [
    ("pre-forward", ["without gradients", "ranks [0]", "ranks [1]", "evaluation on every rank"]),
    ("non-root-forward", ["'blocks.1'", "'blocks.2'", "cannot fix forward-side divergence"]),
    ("backward", ["'aux'", "set_reduce_scatter_unused_params(True)"]),
    ("end-of-backward", ["'never'", "end-of-backward all-reduce"]),
    ("optimizer-step", ["fsdp_compose.clip_grad_norm_",
                        "rank 1 is blocked in torch.distributed.barrier() at"]),
]


@pytest.mark.parametrize("at_step", [0, 1])
@pytest.mark.parametrize("phase,names", PHASES, ids=[p for p, _ in PHASES])
def test_divergence_in_the_first_two_iterations_is_named_on_every_rank(phase, names, at_step):
    results = run_distributed(2, _diverge_at, phase, at_step, timeout=TIMEOUT)
    for rank, result in enumerate(results):
        if phase == "optimizer-step" and rank == 1:
            continue  # rank 1 never called clip_grad_norm_: nothing to raise there
        assert result is not None, f"rank {rank} trained through the divergence"
        got_step, seconds, message = result
        assert got_step == at_step, f"rank {rank}: raised at step {got_step}: {message}"
        assert seconds < 15, f"rank {rank} took {seconds:.1f} s to raise"
        assert f"[rank {rank}]" in message, message
        for name in names:
            assert name in message, f"rank {rank}: {name!r} not in:\n{message}"


def test_evaluation_on_every_rank_is_not_divergence():
    assert run_distributed(2, _diverge_at, "every-rank-evaluates", 0, timeout=TIMEOUT) == \
        [None, None]


def _all_gathers_per_forward(accumulate: int, forwards: int):
    """All-gathers of each root forward: ``accumulate`` micro-batches with
    backward (gradient accumulation, the last one ends the step), or, with
    ``accumulate=0``, ``forwards`` evaluations under ``torch.no_grad()``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = _group()
    model = _build(group)
    counts = []
    for step in range(forwards):
        x, y = _batch(step, world)
        with CollectiveCounter() as comm:
            if accumulate:
                model.set_is_last_backward(step % accumulate == accumulate - 1)
                _rank_loss(model, x[rank::world], y[rank::world], rank, range(world)).backward()
            else:
                with torch.no_grad():
                    model(x[rank::world])
        counts.append(comm.counts[ALL_GATHER])
    dist.destroy_process_group(group)
    return counts


def test_a_model_that_only_evaluates_stops_verifying_after_the_limit():
    counts = run_distributed(2, _all_gathers_per_forward, 0, VERIFICATION_FORWARD_LIMIT + 2,
                             timeout=TIMEOUT)[0]
    verified, steady = counts[1], counts[-1]
    assert steady < verified  # the verification all-gathers are gone
    assert counts[1:] == [verified] * (VERIFICATION_FORWARD_LIMIT - 1) + [steady] * 2, counts


def test_gradient_accumulation_is_verified_until_two_steps_end():
    """Micro-batch forwards have gradients: they do not close the window,
    the end of the second step does (6 micro-batches per step: more
    forwards than VERIFICATION_FORWARD_LIMIT before the second step ends)."""
    counts = run_distributed(2, _all_gathers_per_forward, 6, 18, timeout=TIMEOUT)[0]
    verified, steady = counts[6:12], counts[12:18]
    assert all(v > s for v, s in zip(verified, steady)), counts
    assert counts[1:6] == verified[1:], counts  # the first step: verified too
