"""Shared pytest setup: the ``distributed`` fixture and shutdown of the worker pools."""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import DistRunner, shutdown_pools

# One intra-op thread in the test process, as in the harness's workers and torchrun's
# ranks, and in the processes the tests start (they inherit the variable). The suite's
# tensors are small: an OpenMP pool of a thread per core gains nothing on them and its
# threads spin for CPU while they wait (a one-process reference of tests/core/test_parity.py,
# 3 AdamW steps: 0.06 CPU seconds with one thread, 3.4 with two on a loaded 2-core machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture
def distributed() -> DistRunner:
    """``distributed.run(world_size, fn, *args, timeout=90, **kwargs)`` -> per-rank results."""
    return DistRunner()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_pools()
