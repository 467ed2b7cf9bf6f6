"""Tests of the multi-process harness itself: results, errors, hangs and dead workers."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import (
    DistRunner,
    DistributedTestError,
    DistributedTimeoutError,
    FAILURE_GRACE,
    THREAD_LIMIT,
    WorkerDiedError,
    pool_pids,
    run_distributed,
)

# Worker functions: module-level so they pickle by reference.


def _rank_info(base: float, *, scale: float = 1.0) -> dict[str, object]:
    t = torch.tensor([base + dist.get_rank()]) * scale
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum": t.item(),
        "rand": torch.rand(3, requires_grad=True) * 1,  # non-leaf: the harness detaches it
        "threads": torch.get_num_threads(),
    }


def _consume_rng() -> None:
    torch.rand(100)
    torch.set_grad_enabled(False)


def _pid() -> int:
    return os.getpid()


def _fail_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}")
    return dist.get_rank()


def _fail_everywhere() -> None:
    raise KeyError(f"all ranks fail, this is rank {dist.get_rank()}")


def _raise_before_all_reduce() -> None:
    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 gives up before the collective")
    t = torch.ones(1)
    dist.all_reduce(t)  # waits for rank 0 forever (well, 60 s)


def _sleep_forever_on_last_rank() -> int:
    if dist.get_rank() == dist.get_world_size() - 1:
        while True:
            time.sleep(1)
    return dist.get_rank()


def _die_on_rank_1() -> None:
    if dist.get_rank() == 1:
        os._exit(7)
    dist.barrier()  # rank 0 is left waiting for the dead rank


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_per_rank_and_all_reduce(world_size: int) -> None:
    results = run_distributed(world_size, _rank_info, 1.0, scale=2.0)
    expected_rand = torch.rand(3, generator=torch.Generator().manual_seed(0))
    assert [r["rank"] for r in results] == list(range(world_size))
    n = world_size
    for r in results:
        assert r["world_size"] == n
        assert r["sum"] == 2.0 * (n * 1.0 + n * (n - 1) / 2)
        assert r["threads"] == 1
        assert not r["rand"].requires_grad
        torch.testing.assert_close(r["rand"], expected_rand)  # seeded with 0 before each call


def test_state_is_reset_between_calls(distributed: DistRunner) -> None:
    distributed.run(2, _consume_rng)
    results = distributed.run(2, _rank_info, 0.0)
    expected = torch.rand(3, generator=torch.Generator().manual_seed(0))
    for r in results:
        torch.testing.assert_close(r["rand"], expected)


def test_exception_on_one_rank_reports_its_traceback() -> None:
    pids = run_distributed(2, _pid)
    with pytest.raises(DistributedTestError) as info:
        run_distributed(2, _fail_on_rank, 1)
    msg = str(info.value)
    assert "rank(s) [1] raised" in msg
    assert "[rank 0] returned normally" in msg
    assert "[rank 1] Traceback (most recent call last)" in msg
    assert "in _fail_on_rank" in msg
    assert "ValueError: boom from rank 1" in msg
    assert not isinstance(info.value, DistributedTimeoutError)
    assert run_distributed(2, _pid) == pids  # same workers: no restart needed


def test_exception_on_all_ranks_keeps_pool() -> None:
    pids = run_distributed(3, _pid)
    with pytest.raises(AssertionError) as info:
        run_distributed(3, _fail_everywhere)
    for rank in range(3):
        assert f"[rank {rank}] Traceback" in str(info.value)
        assert f"KeyError: 'all ranks fail, this is rank {rank}'" in str(info.value)
    assert run_distributed(3, _pid) == pids


def _make_groups(count: int) -> int:
    """``count`` new gloo groups, never destroyed; this worker's pid."""
    for _ in range(count):
        dist.new_group(backend="gloo")
    return os.getpid()


def test_a_pool_left_with_many_threads_is_replaced() -> None:
    """Each process group adds gloo threads that stay; past ``THREAD_LIMIT``
    the pool is replaced after the call, so idle threads never pile up."""
    pids = run_distributed(2, _pid)
    assert run_distributed(2, _make_groups, 1) == pids  # a few threads more: kept
    assert pool_pids(2) == pids
    assert run_distributed(2, _make_groups, THREAD_LIMIT) == pids  # the call itself ran there
    assert pool_pids(2) == []  # ... then the pool was retired
    assert set(run_distributed(2, _pid)).isdisjoint(pids)


def test_hang_in_collective_is_reported_with_every_rank_stack() -> None:
    old_pids = run_distributed(2, _pid)
    start = time.monotonic()
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(2, _raise_before_all_reduce, timeout=60)
    elapsed = time.monotonic() - start
    assert FAILURE_GRACE <= elapsed < FAILURE_GRACE + 10  # not the 60 s timeout
    msg = str(info.value)
    assert f"rank(s) [1] still running {FAILURE_GRACE:g} s after rank(s) [0] raised" in msg
    assert "[rank 0] Traceback" in msg
    assert "RuntimeError: rank 0 gives up before the collective" in msg
    assert "[rank 1] timed out; Python stack:" in msg
    rank1 = msg.split("[rank 1]", 1)[1]
    assert "in all_reduce" in rank1  # faulthandler dump of the stuck rank
    assert "in _raise_before_all_reduce" in rank1
    assert pool_pids(2) == []  # the hung pool was killed ...
    new_pids = run_distributed(2, _pid)  # ... and is recreated on next use
    assert set(new_pids).isdisjoint(old_pids)
    assert [r["sum"] for r in run_distributed(2, _rank_info, 0.0)] == [1.0, 1.0]


def test_sleeping_rank_is_reported() -> None:
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(3, _sleep_forever_on_last_rank, timeout=2)
    msg = str(info.value)
    assert "[rank 0] returned normally" in msg
    assert "[rank 1] returned normally" in msg
    assert "in _sleep_forever_on_last_rank" in msg.split("[rank 2]", 1)[1]


def test_dead_worker_is_detected_promptly() -> None:
    run_distributed(2, _pid)  # pool start-up is not part of what is timed
    start = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        run_distributed(2, _die_on_rank_1, timeout=60)
    assert time.monotonic() - start < 10
    msg = str(info.value)
    assert "[rank 1] worker process died, exit code 7" in msg
    assert "[rank 0]" in msg  # either gloo's error or rank 0's stack in the barrier
    assert run_distributed(2, _fail_on_rank, -1) == [0, 1]


def test_unpicklable_function_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(1, lambda: 1)
