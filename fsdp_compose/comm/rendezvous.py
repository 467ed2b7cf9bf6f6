"""Collective calls made on some ranks only end in a message, not a hang.

[Note: call rendezvous]
A collective entry point that users call (``state_dict()`` through our
hooks, ``clip_grad_norm_``, ``unshard()``, ``materialize``, checkpoint
saves) and that one rank skips (``if rank == 0: model.state_dict()``) would
leave the ranks that made it waiting in the backend until the process
group's timeout (30 minutes by default), then fail with a backend error
that names no call. :func:`arrive` runs before the call's first collective:
every rank writes one key to the rendezvous store (torch.distributed's
default store: no collective, nothing the backend can pair with another
collective) and waits, at most :func:`call_timeout` seconds, for the keys
of every member of the group. Missing keys raise, on the ranks that made
the call, an error naming the call and the ranks that did not make it (or
made another call there). Keys are named by the group and numbered by the
group's collective sequence number and the calls since, so a group's calls
pair by order, like its collectives, and a call made on some ranks only
does not shift the pairing of later calls once the group ran a collective.

Cost: three round trips to the store (set, wait, multi-get) plus the
deletion of this rank's key of the group's previous call (every rank has
read it once all keys of this call exist). Per-step callers check only in
the verified iterations (``checked_now``), so the steady-state step pays
nothing.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional, Sequence

import torch.distributed as dist

CALL_TIMEOUT_ENV = "FSDP_COMPOSE_CALL_TIMEOUT"
"""Seconds a rank waits for the others at a collective call (default 30)."""
DEFAULT_CALL_TIMEOUT = 30.0
_PREFIX = "fsdp_compose/call"
_calls: dict[str, tuple[int, int]] = {}
"""group name -> (its collective sequence number, calls made since it)."""
_last_key: dict[str, str] = {}
"""group name -> this rank's key of its previous call (deleted at the next)."""


class CallMismatchError(RuntimeError):
    """A collective call of fsdp_compose was made on some ranks only."""


def call_timeout() -> float:
    """Seconds :func:`arrive` waits (``FSDP_COMPOSE_CALL_TIMEOUT``, read at
    every call so a test or a debugging session may change it)."""
    value = os.environ.get(CALL_TIMEOUT_ENV, "")
    return float(value) if value else DEFAULT_CALL_TIMEOUT


def arrive(process_group: Optional[dist.ProcessGroup], call: str, fix: str) -> None:
    """Meet every rank of ``process_group`` (the default group if ``None``)
    at ``call`` before its first collective, or raise
    :class:`CallMismatchError` naming the ranks that did not come (see
    [Note: call rendezvous]). ``fix`` ends the message. A no-op over one
    rank or without a default store."""
    if not dist.is_initialized():
        return
    group = process_group if process_group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == 1:
        return
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return  # no default group (a mesh of its own): nothing to meet through
    me = dist.get_rank()
    base = f"{_PREFIX}/{group.group_name}/{_next_number(group)}"
    keys = [f"{base}/{rank}" for rank in ranks]
    store.set(f"{base}/{me}", call)
    timeout = call_timeout()
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except (RuntimeError, dist.DistStoreError):
        _raise_missing(store, keys, ranks, me, call, fix, timeout)
    names = [value.decode() for value in store.multi_get(keys)]
    previous = _last_key.get(group.group_name)
    if previous is not None:
        store.delete_key(previous)  # every rank read it: all keys of this call exist
    _last_key[group.group_name] = f"{base}/{me}"
    if any(name != call for name in names):
        _raise(me, call, [], {r: n for r, n in zip(ranks, names) if n != call}, fix, timeout)


def _next_number(group: dist.ProcessGroup) -> str:
    """``<collectives issued on group so far>.<calls since then>``: the
    same on every rank that made the same collectives and calls, and
    back in step after a call made on some ranks only as soon as the group
    runs its next collective (a local count alone would stay apart)."""
    try:
        issued = group._get_sequence_number_for_group()
    except (RuntimeError, AttributeError):
        issued = -1  # a backend without sequence numbers: calls are counted alone
    seen, count = _calls.get(group.group_name, (issued, 0))
    count = count if seen == issued else 0
    _calls[group.group_name] = (issued, count + 1)
    return f"{issued}.{count}"


def _raise_missing(store: dist.Store, keys: Sequence[str], ranks: Sequence[int], me: int,
                   call: str, fix: str, timeout: float) -> None:
    missing, other = [], {}
    for rank, key in zip(ranks, keys):
        if not store.check([key]):
            missing.append(rank)
            continue
        name = store.get(key).decode()
        if name != call:
            other[rank] = name
    _raise(me, call, missing, other, fix, timeout)


def _raise(me: int, call: str, missing: list[int], other: dict[int, str], fix: str,
           timeout: float) -> None:
    parts = []
    if missing:
        parts.append(f"ranks {missing} did not call it within {timeout:g} s")
    if other:
        parts.append("; ".join(f"rank {rank} called {name} there instead"
                               for rank, name in other.items()))
    raise CallMismatchError(
        f"[rank {me}] {call} is collective (every rank of its process group must call it, in "
        f"the same order as the other collective calls), but {', and '.join(parts)}. "
        f"Nothing was communicated. {fix} (The wait is {CALL_TIMEOUT_ENV} seconds, default "
        f"{DEFAULT_CALL_TIMEOUT:g}.)")
