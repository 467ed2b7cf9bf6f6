"""Shared pytest setup: the ``distributed`` fixture and shutdown of the worker pools."""

from __future__ import annotations

import pytest

from tests.harness import DistRunner, shutdown_pools


@pytest.fixture
def distributed() -> DistRunner:
    """``distributed.run(world_size, fn, *args, timeout=90, **kwargs)`` -> per-rank results."""
    return DistRunner()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_pools()
