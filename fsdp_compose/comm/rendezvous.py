"""Collective calls made on some ranks only end in a message, not a hang.

[Note: call rendezvous]
A user-facing collective call (``state_dict()``, ``clip_grad_norm_``,
checkpoint saves) one rank skips would leave the others waiting until the
backend's timeout. So :func:`arrive` runs before the call's first
collective: every rank writes one key to the default store and waits for
every member's, raising at once for a member waiting elsewhere or blocked,
and waiting up to :func:`call_timeout` for a late one. Keys are numbered by
the group's collective sequence number, so calls pair in order.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Callable, Optional, Sequence

import torch.distributed as dist

from .._torch_private import default_store, sequence_number
from .whereabouts import Doing, answer, ask, start_watcher

CALL_TIMEOUT_ENV = "FSDP_COMPOSE_CALL_TIMEOUT"
DEFAULT_CALL_TIMEOUT = 1800.0  # torch's default collective timeout
_PREFIX = "fsdp_compose/call"
_calls: dict[str, tuple[int, int]] = {}
_last_key: dict[str, str] = {}


class CallMismatchError(RuntimeError):
    """A collective call of fsdp_compose was made on some ranks only."""


def call_timeout() -> float:
    """Seconds :func:`arrive` waits (``FSDP_COMPOSE_CALL_TIMEOUT``, default 1800)."""
    value = os.environ.get(CALL_TIMEOUT_ENV, "")
    return float(value) if value else DEFAULT_CALL_TIMEOUT


def arrive(process_group: Optional[dist.ProcessGroup], call: str, fix: str) -> None:
    """Meet every rank of ``process_group`` (``None``: the default group) at
    ``call``, or raise :class:`CallMismatchError` naming the missing ranks,
    ending with ``fix``."""
    if not dist.is_initialized():
        return
    group = process_group if process_group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == 1:
        return
    try:
        default_store()
    except (RuntimeError, ValueError):
        return  # no default group: nothing to meet through
    me = dist.get_rank()
    base = f"{_PREFIX}/{group.group_name}/{_next_number(group)}"
    timeout = call_timeout()
    said = [0.0]

    def waiting(waited: float, elsewhere: dict[int, str], doing: dict[int, Doing]) -> None:
        other = {rank: where for rank, where in elsewhere.items() if where}
        if other:  # a mismatch: they wait at another call
            _raise(me, call, [], {}, fix, timeout, waiting_at=other)
        blocked = {rank: d for rank, d in doing.items() if d.kind == "blocked"}
        if blocked:  # in a collective that waits for this rank
            _raise_blocked(me, call, blocked, fix)
        if waited >= timeout:
            _raise(me, call, sorted(elsewhere), {}, fix, timeout)
        if waited - said[0] >= LATE_NOTICE_SECONDS:  # late, not (yet) wrong: say so
            said[0] = waited
            what = "".join(f"; rank {rank} runs {d.says()}" for rank, d in sorted(doing.items()))
            print(f"[rank {me}] fsdp_compose: {call} waits for ranks {sorted(elsewhere)}, which "
                  f"have not reached any collective call of fsdp_compose yet ({waited:.0f} s of "
                  f"{timeout:g} s, {CALL_TIMEOUT_ENV}){what}", file=sys.stderr, flush=True)

    names = meet(base, ranks, me, call, call, waiting, _last_key.get(group.group_name))
    _last_key[group.group_name] = f"{base}/{me}"
    left = {r: n[len(LEFT):] for r, n in zip(ranks, names) if n.startswith(LEFT)}
    if left:
        _raise(me, call, [], {}, fix, timeout, waiting_at=left)
    if any(name != call for name in names):
        _raise(me, call, [], {r: n for r, n in zip(ranks, names) if n != call}, fix, timeout)


# [Note: where each rank waits]
# A rank at a meeting writes what it waits at under ``fsdp_compose/where/<rank>`` until it leaves;
# a missing rank waiting at *another* meeting will never come. Polled with ``check`` (the store's
# blocking ``wait`` logs socket warnings).
_WHERE = "fsdp_compose/where"
POLL_ENV = "FSDP_COMPOSE_POLL_SECONDS"
"""Seconds between looks at the missing ranks (``FSDP_COMPOSE_POLL_SECONDS``)."""
DEFAULT_POLL_SECONDS = 1.0
LATE_NOTICE_SECONDS = 30.0
_MAX_SLEEP = 0.002
_PUBLISH_AFTER = 0.05


def poll_seconds() -> float:
    value = os.environ.get(POLL_ENV, "")
    return float(value) if value else DEFAULT_POLL_SECONDS


Waiting = Callable[[float, dict[int, str], dict[int, Doing]], None]
"""Told while a meeting waits: (seconds waited, {missing rank: meeting it
waits at}, {missing rank: what it does})."""


def meet(prefix: str, ranks: Sequence[int], me: int, value: str, what: str,
         waiting: Waiting,
         previous: Optional[str] = None) -> list[str]:
    """Every rank's ``value`` in the order of ``ranks``, through the default
    store; calls ``waiting`` (which may raise) while some are missing, and
    deletes ``previous``, this rank's key of the last meeting."""
    store = default_store()
    start_watcher()
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


def _wait_for(store: dist.Store, keys: list[str], ranks: Sequence[int], me: int, what: str,
              prefix: str, waiting: Waiting) -> None:
    start, poll = time.monotonic(), poll_seconds()
    next_look, sleep, published = start + poll, 5e-5, False
    asking = _Asking(me)
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
            next_look = now + poll
            missing = [r for r, key in zip(ranks, keys) if not store.check([key])]
            elsewhere = {r: _where_of(store, r) for r in missing}
            doing = asking.look([r for r, (w, at) in elsewhere.items() if not w])
            try:
                waiting(now - start, {r: w for r, (w, at) in elsewhere.items() if at != prefix},
                        doing)
            except BaseException:
                for rank, (_, at) in elsewhere.items():
                    if at and at not in (prefix, _EXITED):  # it waits for this rank there
                        store.set(f"{at}/{me}", LEFT + what)
                raise
    finally:
        if published:
            store.set(f"{_WHERE}/{me}", "")


class _Asking:
    """Questions to the watchers of missing ranks ([Note: blocked is not late])."""

    def __init__(self, me: int) -> None:
        self.me: int = me
        self.asked: dict[int, int] = {}
        self.said: dict[int, Doing] = {}

    def look(self, ranks: list[int]) -> dict[int, Doing]:
        """Ask ``ranks`` again; ``"blocked"`` where two answers in a row name the
        same collective waiting for this rank."""
        for rank in ranks:
            number = self.asked.get(rank)
            if number is not None:
                now = answer(rank, number)
                if now is None:
                    continue  # not answered yet
                before = self.said.get(rank)
                if before is not None and before.token and before.token == now.token and \
                        now.waits_for(self.me):
                    now = now._replace(kind="blocked")
                self.said[rank] = now
            self.asked[rank] = ask(rank)
        return {rank: self.said[rank] for rank in ranks if rank in self.said}


_exit_marked: list[bool] = []
_EXITED = "exited"


def _mark_exit(store: dist.Store, me: int) -> None:
    """At exit: tell ranks waiting for this one that it will never come."""
    try:
        store.set(f"{_WHERE}/{me}", f"the end of its process (it exited)\n{_EXITED}")
    except Exception:  # noqa: BLE001 - the store may be gone already; nothing to tell then
        pass


def _where_of(store: dist.Store, rank: int) -> tuple[str, str]:
    key = f"{_WHERE}/{rank}"
    if not store.check([key]):
        return "", ""
    what, _, at = store.get(key).decode().partition("\n")
    return (what, at) if what else ("", "")


def _next_number(group: dist.ProcessGroup) -> str:
    """Equal on ranks that made the same collectives and calls."""
    try:
        issued = sequence_number(group)
    except (RuntimeError, AttributeError):
        issued = -1  # no sequence numbers: calls are counted alone
    seen, count = _calls.get(group.group_name, (issued, 0))
    count = count if seen == issued else 0
    _calls[group.group_name] = (issued, count + 1)
    return f"{issued}.{count}"


def _raise_blocked(me: int, call: str, blocked: dict[int, Doing], fix: str) -> None:
    parts = "; ".join(d.blocks(rank) for rank, d in sorted(blocked.items()))
    raise CallMismatchError(
        f"[rank {me}] {call} is collective (every rank of its process group must call it, in "
        f"the same order as the other collective calls), but {parts}: neither can go on "
        f"(this rank raises at once; the blocked collective fails when this process exits). "
        f"Nothing was communicated. {fix}")


def _raise(me: int, call: str, missing: list[int], other: dict[int, str], fix: str,
           timeout: float, waiting_at: Optional[dict[int, str]] = None) -> None:
    parts = [f"rank {rank} waits at {what} instead"
             for rank, what in (waiting_at or {}).items()]
    if missing:
        parts.append(f"ranks {missing} did not call it within {timeout:g} s")
    if other:
        parts.append("; ".join(f"rank {rank} called {name} there instead"
                               for rank, name in other.items()))
    raise CallMismatchError(  # from no store error: this is what a user reads
        f"[rank {me}] {call} is collective (every rank of its process group must call it, in "
        f"the same order as the other collective calls), but {', and '.join(parts)}. "
        f"Nothing was communicated. {fix} (The wait is {CALL_TIMEOUT_ENV} seconds, default "
        f"{DEFAULT_CALL_TIMEOUT:g}.)")
