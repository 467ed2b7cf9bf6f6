"""Each rank's recent collectives, compared through the store when a wait
stalls or fails ([Note: flight log] in ``comm/wire.py``).
"""

from __future__ import annotations

import json
import time
from collections import deque
from itertools import count
from typing import Callable, NamedTuple, Optional

import torch.distributed as dist

from .._torch_private import default_store
from ..comm.wire import stall_seconds, watch

RING_SIZE = 256
"""Collectives remembered per process group."""
_PREFIX = "fsdp_compose/flight"
_models: dict[str, int] = {}
"""Group name -> models attached (keys one model's entries)."""

Describe = Callable[[int], str]
Advice = Callable[[list[int]], str]


class Ring(NamedTuple):
    """One group's recent collectives: ``entries.append((next(serial),
    iteration, code))`` records one."""

    entries: "deque[tuple[int, int, int]]"
    serial: "count[int]"


class FlightRecorder:
    """The ring of one model's collectives, per process group."""

    def __init__(self, describe: Describe, advice: Advice) -> None:
        self._rings: dict[int, Ring] = {}
        """By id(process group)."""
        self._describe: Describe = describe
        self._advice: Advice = advice
        self._keys: dict[str, str] = {}

    def attach(self, process_group: dist.ProcessGroup) -> Ring:
        """Watch ``process_group``'s waits (once) and return its ring."""
        name = process_group.group_name
        number = _models.get(name, 0)
        _models[name] = number + 1
        self._keys[name] = f"{_PREFIX}/{name}/{number}"
        watch(process_group, self)
        return self._rings.setdefault(id(process_group), Ring(deque(maxlen=RING_SIZE), count()))

    def stalled(self, process_group: dist.ProcessGroup, error: Optional[BaseException],
                waited: float) -> None:
        """Publish this rank's ring, read the others', raise where they disagree
        (with ``error``, naming the ranks that published nothing)."""
        try:
            store = default_store()
        except (RuntimeError, ValueError):
            return  # no store
        me = dist.get_rank()
        ranks = dist.get_process_group_ranks(process_group)
        prefix = self._keys.get(process_group.group_name, f"{_PREFIX}/{process_group.group_name}")
        keys = {rank: f"{prefix}/{rank}" for rank in ranks}
        held = self._rings.get(id(process_group))
        entries = list(held.entries) if held is not None else []
        start = entries[0][0] if entries else 0
        store.set(keys[me], json.dumps([start, [[i, code] for _, i, code in entries]]))
        deadline = time.monotonic() + (2 * stall_seconds() if error is not None else 0.0)
        while True:
            logs = {rank: _read(store, key) for rank, key in keys.items()}
            logs = {rank: log for rank, log in logs.items() if log is not None}
            complete = len(logs) == len(ranks)
            found = _first_difference(logs, complete)
            if found is not None or complete or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if found is None and error is None:
            return  # keep waiting
        if found is None and complete:
            return  # the same everywhere
        raise RuntimeError(self._message(me, process_group, logs, found, error, waited,
                                         [r for r in ranks if r not in logs])) from error

    def recovered(self, process_group: dist.ProcessGroup) -> None:
        """The stalled wait finished."""
        try:
            store = default_store()
            prefix = self._keys.get(process_group.group_name,
                                    f"{_PREFIX}/{process_group.group_name}")
            store.delete_key(f"{prefix}/{dist.get_rank()}")
        except (RuntimeError, ValueError):
            pass

    def _message(self, me: int, process_group: dist.ProcessGroup, logs: dict,
                 found: Optional[int], error: Optional[BaseException], waited: float,
                 missing: list[int]) -> str:
        how = (f"a collective failed ({str(error).splitlines()[0][:200]})" if error is not None
               else f"a collective waited {waited:g} s")
        lines = []
        if found is not None:
            codes = []
            for rank, (start, ring) in sorted(logs.items()):
                entry = ring[found - start] if found - start < len(ring) else None
                if entry is None:
                    lines.append(f"  rank {rank} issued nothing more (it waits for an earlier one)")
                else:
                    lines.append(f"  rank {rank} ran the {self._describe(entry[1])} at iteration "
                                 f"{entry[0]}")
                    codes.append(entry[1])
            head = (f"fully_shard ranks diverged: collective #{found} of process group "
                    f"{process_group.group_name} differs between the ranks")
            advice = self._advice(codes)
        else:
            start, ring = logs[me]
            last = ", ".join(f"{self._describe(code)} (iteration {it})" for it, code in ring[-3:])
            head = ("fully_shard ranks may have diverged: their collective logs could not be "
                    f"compared (this rank's last ones: {last or 'none'})")
            advice = ("Rank-dependent control flow is the usual cause: every rank must run the "
                      "same units, forward and backward, in the same order.")
        if missing:
            lines.append(f"  ranks {missing} published no log: their process ended (gloo aborts "
                         "a rank that receives a collective of another size than it posted; see "
                         "its output) or they wait outside fsdp_compose")
        return (f"[rank {me}] {head} (found after {how}, by comparing each rank's recent "
                "collectives through the rendezvous store):\n" + "\n".join(lines) +
                f"\n{advice} To find it before any collective pairs wrongly, set "
                "FSDP_COMPOSE_CHECK_ORDER=1 (or call set_check_rank_divergence(True) on the root).")


def _read(store: dist.Store, key: str) -> Optional[tuple[int, list[tuple[int, int]]]]:
    if not store.check([key]):
        return None
    start, ring = json.loads(store.get(key).decode())
    return start, [tuple(entry) for entry in ring]


def _first_difference(logs: dict, complete: bool) -> Optional[int]:
    """The first position where the rings disagree."""
    if len(logs) < 2:
        return None
    low = max(start for start, _ in logs.values())
    high = max(start + len(ring) for start, ring in logs.values())
    for number in range(low, high):
        codes = {ring[number - start][1] if number - start < len(ring) else None
                 for start, ring in logs.values()}
        present = codes - {None}
        if len(present) > 1 or (complete and None in codes and present):
            return number
    return None
