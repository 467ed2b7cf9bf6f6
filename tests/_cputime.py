"""CPU seconds per test and per file: where the suite's time goes, whatever the load.

    PYTHONPATH=. python -m pytest -p tests._cputime -q tests/core/test_parity.py
    FSDP_COMPOSE_CPUTIME=cpu.tsv PYTHONPATH=. python -m pytest -p tests._cputime -q

A test's CPU is this process's, plus what the harness's workers (``tests/harness.py``)
used meanwhile, plus what the children reaped meanwhile used (torchrun jobs, ``python -c``
probes, a pool killed and replaced) and what ``harness.run_fresh``'s processes used. Wall-clock time on a shared machine measures the
neighbours; CPU seconds barely move with them. A pool's start is charged to the test
that starts it. The terminal summary ranks the files; ``FSDP_COMPOSE_CPUTIME`` names a
file that gets one line per test (node id, CPU seconds, wall seconds), appended.
At the end the fork server is stopped and reaped, so a wrapper's
``RUSAGE_CHILDREN`` (e.g. ``/usr/bin/time``) counts it and the workers it forked.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import resource
import time
from collections import defaultdict
from collections.abc import Generator

import pytest

from tests import harness

_TICK = os.sysconf("SC_CLK_TCK")
_per_test: dict[str, float] = {}
_worker_cpu: dict[int, float] = {}  # worker pid -> CPU seconds already charged


def _cpu_of(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def _workers() -> dict[int, float]:
    found = {}
    for pool in list(harness._pools.values()):
        for pid in pool.pids:
            if pid is not None and (cpu := _cpu_of(pid)) is not None:
                found[pid] = cpu
    return found


def _own_and_reaped() -> tuple[float, float]:
    """This process's CPU; its reaped children's, plus ``run_fresh``'s processes (the fork
    server's children, which it reaps)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, reaped.ru_utime + reaped.ru_stime + harness.fresh_cpu_seconds


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator:
    _worker_cpu.update(_workers())
    own0, reaped0 = _own_and_reaped()
    start = time.monotonic()
    yield
    own1, reaped1 = _own_and_reaped()
    workers = _workers()
    used = sum(cpu - _worker_cpu.get(pid, 0.0) for pid, cpu in workers.items())
    # a worker gone since (a pool replaced or shut down): its CPU is in RUSAGE_CHILDREN,
    # of which this much was charged before
    charged = sum(_worker_cpu.pop(pid) for pid in list(_worker_cpu) if pid not in workers)
    _worker_cpu.update(workers)
    total = (own1 - own0) + used + max(0.0, reaped1 - reaped0 - charged)
    _per_test[item.nodeid] = total
    if out := os.environ.get("FSDP_COMPOSE_CPUTIME"):
        with open(out, "a") as f:
            f.write(f"{item.nodeid}\t{total:.3f}\t{time.monotonic() - start:.3f}\n")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    per_file: dict[str, float] = defaultdict(float)
    for nodeid, cpu in _per_test.items():
        per_file[nodeid.split("::")[0]] += cpu
    own, reaped = _own_and_reaped()
    terminalreporter.section("CPU seconds (tests/_cputime.py)")
    terminalreporter.write_line(f"{sum(_per_test.values()):.1f} in {len(_per_test)} tests; "
                                f"this process and its reaped children so far: {own + reaped:.1f}")
    for path, cpu in sorted(per_file.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{cpu:8.1f}  {path}")
    for nodeid, cpu in sorted(_per_test.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{cpu:8.1f}  {nodeid}")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    harness.shutdown_pools()
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)  # private, 3.8+
    if stop is not None:
        stop()
