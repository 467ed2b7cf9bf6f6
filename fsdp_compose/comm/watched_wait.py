"""Waiting on collectives, telling a watcher of stalls.

[Note: flight log]
A backend fails naming no unit, so a wait that stalls past :func:`stall_seconds` or raises
tells its group's watcher, which compares the ranks' logs.
"""

from __future__ import annotations

import os
import weakref
from datetime import timedelta
from typing import Optional, Protocol

import torch.distributed as dist

STALL_ENV = "FSDP_COMPOSE_STALL_SECONDS"
"""Seconds a collective may wait before its watcher is told (default 10)."""
DEFAULT_STALL_SECONDS = 10.0


class Watcher(Protocol):

    def stalled(self, process_group: dist.ProcessGroup, error: Optional[BaseException],
                waited: float) -> None:
        """Stalled ``waited`` seconds, or raised ``error``."""

    def recovered(self, process_group: dist.ProcessGroup) -> None:
        """The stalled wait finished."""


_watchers: "dict[str, weakref.ref[Watcher]]" = {}


def watch(process_group: dist.ProcessGroup, watcher: Watcher) -> None:
    """Gloo only (a timed wait elsewhere blocks)."""
    if dist.get_backend(process_group) == "gloo":
        _watchers[process_group.group_name] = weakref.ref(watcher)


def stall_seconds() -> float:
    value = os.environ.get(STALL_ENV, "")
    return float(value) if value else DEFAULT_STALL_SECONDS


def wait_watched(work, process_group: Optional[dist.ProcessGroup]) -> None:
    """``work.wait()`` ([Note: flight log])."""
    ref = _watchers.get(process_group.group_name) if process_group is not None else None
    watcher = ref() if ref is not None else None
    if watcher is None:
        work.wait()
        return
    stall = stall_seconds()
    waited, told = 0.0, False
    while True:
        try:
            work.wait(timedelta(seconds=stall))
            break
        except RuntimeError as error:
            if not _is_timeout(error):
                watcher.stalled(process_group, error, waited)
                raise
            waited += stall
            told = True
            watcher.stalled(process_group, None, waited)
    if told:
        watcher.recovered(process_group)


def _is_timeout(error: RuntimeError) -> bool:
    return "Operation timed out!" in str(error) and "Timed out waiting" not in str(error)
