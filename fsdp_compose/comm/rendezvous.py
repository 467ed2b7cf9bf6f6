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
collective) and waits for the keys of every member of the group. A member
that waits at another meeting of the library (another call, a forward
agreement) will never come: the call raises at once, on every rank that
waits, naming where each rank is ([Note: where each rank waits]). A member
at no meeting is late (a long evaluation on one rank) and is waited for up
to :func:`call_timeout` (the collective timeout, 30 minutes, by default),
with a line every ``LATE_NOTICE_SECONDS``; then the call raises naming it.
Keys are named by the group and numbered by the group's collective
sequence number and the calls since, so a group's calls pair by order,
like its collectives, and a call made on some ranks only does not shift
the pairing of later calls once the group ran a collective.

Cost: four round trips to the store (set, check, multi-get, and the
deletion of this rank's key of the group's previous call) when the ranks
arrive together, so every call checks, per-step ones included.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Callable, Optional, Sequence

import torch.distributed as dist

from .._torch_private import default_store, sequence_number

CALL_TIMEOUT_ENV = "FSDP_COMPOSE_CALL_TIMEOUT"
"""Seconds a rank waits for the others at a collective call (default 30)."""
DEFAULT_CALL_TIMEOUT = 1800.0  # torch's default collective timeout
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
        default_store()
    except (RuntimeError, ValueError):
        return  # no default group (a mesh of its own): nothing to meet through
    me = dist.get_rank()
    base = f"{_PREFIX}/{group.group_name}/{_next_number(group)}"
    timeout = call_timeout()
    said = [0.0]

    def waiting(waited: float, elsewhere: dict[int, str]) -> None:
        other = {rank: where for rank, where in elsewhere.items() if where}
        if other:  # a mismatch: they wait at another call, and will never come here
            _raise(me, call, [], {}, fix, timeout, waiting_at=other)
        if waited >= timeout:
            _raise(me, call, sorted(elsewhere), {}, fix, timeout)
        if waited - said[0] >= LATE_NOTICE_SECONDS:  # late, not (yet) wrong: say so
            said[0] = waited
            print(f"[rank {me}] fsdp_compose: {call} waits for ranks {sorted(elsewhere)}, which "
                  f"have not reached any collective call of fsdp_compose yet ({waited:.0f} s of "
                  f"{timeout:g} s, {CALL_TIMEOUT_ENV})", file=sys.stderr, flush=True)

    names = meet(base, ranks, me, call, call, waiting, _last_key.get(group.group_name))
    _last_key[group.group_name] = f"{base}/{me}"
    left = {r: n[len(LEFT):] for r, n in zip(ranks, names) if n.startswith(LEFT)}
    if left:
        _raise(me, call, [], {}, fix, timeout, waiting_at=left)
    if any(name != call for name in names):
        _raise(me, call, [], {r: n for r, n in zip(ranks, names) if n != call}, fix, timeout)


# [Note: where each rank waits]
# A rank that waits at a meeting (a collective call, a forward agreement)
# writes what it waits at under ``fsdp_compose/where/<rank>`` and empties it
# when it leaves. The others, waiting at their own meeting, read it for the
# ranks they miss: a rank that waits at *another* meeting will never come
# (a mismatch: raise at once, naming where it is); a rank at no meeting is
# late (still computing, evaluating, loading) or gone, and is waited for up
# to the call's timeout, with a line every ``LATE_NOTICE_SECONDS``. Polling
# ``check`` (not the store's blocking ``wait``, whose time-outs log socket
# warnings and raise ``DistStoreError``) keeps the error the first thing a
# user reads.
_WHERE = "fsdp_compose/where"
POLL_SECONDS = 1.0
"""How often a waiting rank reads where the ranks it misses are."""
LATE_NOTICE_SECONDS = 30.0
"""How often a rank waiting for late ranks says so."""
_MAX_SLEEP = 0.002
_PUBLISH_AFTER = 0.05
"""Seconds of waiting before a rank says where it waits (ranks a few
milliseconds apart meet without it: two store round trips saved)."""


def meet(prefix: str, ranks: Sequence[int], me: int, value: str, what: str,
         waiting: Callable[[float, dict[int, str]], None],
         previous: Optional[str] = None) -> list[str]:
    """Every rank's ``value``, in the order of ``ranks``, exchanged through
    the default store under ``prefix/<rank>`` (see [Note: where each rank
    waits]). While some are missing, calls ``waiting(seconds waited,
    {missing rank: what it waits at, "" if nothing})`` about every
    :data:`POLL_SECONDS` (it may raise). A rank that raised while waiting
    elsewhere leaves ``LEFT + <what it waited at>`` as its value here.
    Deletes ``previous`` (this rank's key of its previous meeting in the
    same series: every rank read it once all keys of this one exist).
    Four store round trips when the ranks arrive together."""
    store = default_store()
    if not _exit_marked:
        atexit.register(_mark_exit, store, me)
        _exit_marked.append(True)
    keys = [f"{prefix}/{rank}" for rank in ranks]
    store.set(f"{prefix}/{me}", value)
    if not store.check(keys):
        _wait_for(store, keys, ranks, me, what, prefix, waiting)
    values = [item.decode() for item in store.multi_get(keys)]
    if previous is not None:
        store.delete_key(previous)
    return values


LEFT = "!left "
"""Starts the value a rank leaves at another rank's meeting when it raised
while waiting at its own (the rest names where it waited)."""


def _wait_for(store: dist.Store, keys: list[str], ranks: Sequence[int], me: int, what: str,
              prefix: str, waiting: Callable[[float, dict[int, str]], None]) -> None:
    start = time.monotonic()
    next_look, sleep, published = start + POLL_SECONDS, 5e-5, False
    try:
        while not store.check(keys):
            time.sleep(sleep)
            sleep = min(2 * sleep, _MAX_SLEEP)
            now = time.monotonic()
            if not published and now - start >= _PUBLISH_AFTER:  # not a mere skew between ranks
                store.set(f"{_WHERE}/{me}", f"{what}\n{prefix}")
                published = True
            if now < next_look:
                continue
            next_look = now + POLL_SECONDS
            missing = [r for r, key in zip(ranks, keys) if not store.check([key])]
            elsewhere = {r: _where_of(store, r) for r in missing}
            try:
                waiting(now - start, {r: w for r, (w, at) in elsewhere.items() if at != prefix})
            except BaseException:
                for rank, (_, at) in elsewhere.items():
                    if at and at not in (prefix, _EXITED):  # it waits for this rank there
                        store.set(f"{at}/{me}", LEFT + what)
                raise
    finally:
        if published:
            store.set(f"{_WHERE}/{me}", "")


_exit_marked: list[bool] = []
_EXITED = "exited"


def _mark_exit(store: dist.Store, me: int) -> None:
    """At interpreter exit (after an exception or Ctrl-C too): tell ranks
    still waiting for this one that it will never come."""
    try:
        store.set(f"{_WHERE}/{me}", f"the end of its process (it exited)\n{_EXITED}")
    except Exception:  # noqa: BLE001 - the store may be gone already; nothing to tell then
        pass


def _where_of(store: dist.Store, rank: int) -> tuple[str, str]:
    """(what ``rank`` waits at, the prefix of that meeting), or ("", "")
    if it waits at none."""
    key = f"{_WHERE}/{rank}"
    if not store.check([key]):
        return "", ""
    what, _, at = store.get(key).decode().partition("\n")
    return (what, at) if what else ("", "")


def _next_number(group: dist.ProcessGroup) -> str:
    """``<collectives issued on group so far>.<calls since then>``: the
    same on every rank that made the same collectives and calls, and
    back in step after a call made on some ranks only as soon as the group
    runs its next collective (a local count alone would stay apart)."""
    try:
        issued = sequence_number(group)
    except (RuntimeError, AttributeError):
        issued = -1  # a backend without sequence numbers: calls are counted alone
    seen, count = _calls.get(group.group_name, (issued, 0))
    count = count if seen == issued else 0
    _calls[group.group_name] = (issued, count + 1)
    return f"{issued}.{count}"


def _raise(me: int, call: str, missing: list[int], other: dict[int, str], fix: str,
           timeout: float, waiting_at: Optional[dict[int, str]] = None) -> None:
    parts = [f"rank {rank} waits at {what} instead"
             for rank, what in (waiting_at or {}).items()]
    if missing:
        parts.append(f"ranks {missing} did not call it within {timeout:g} s")
    if other:
        parts.append("; ".join(f"rank {rank} called {name} there instead"
                               for rank, name in other.items()))
    raise CallMismatchError(  # from no store error: this is the first thing a user reads
        f"[rank {me}] {call} is collective (every rank of its process group must call it, in "
        f"the same order as the other collective calls), but {', and '.join(parts)}. "
        f"Nothing was communicated. {fix} (The wait is {CALL_TIMEOUT_ENV} seconds, default "
        f"{DEFAULT_CALL_TIMEOUT:g}.)")
