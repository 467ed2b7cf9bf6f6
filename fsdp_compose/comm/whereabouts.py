"""What a rank's main thread is doing, told on request to ranks waiting for it at a meeting.

[Note: blocked is not late]
The store cannot tell a late rank from one blocked in a collective that
waits for the waiting rank (``if rank == 0: torch.save(model.state_dict(),
f)`` then ``dist.barrier()``). So every rank runs a watcher thread that,
asked, reads where its main thread is (``sys._current_frames()``) and
answers with a :class:`Doing`. A rank is *blocked* when that is a
collective including the waiting rank, whose group issued more collectives
there than on the waiting rank, and two answers a poll apart name the same
call; else it is *late*.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from datetime import timedelta
from types import FrameType
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .._torch_private import default_store, group_named, sequence_number

_PREFIX = "fsdp_compose/probe"
_STOP = "stop"
_FOREVER = timedelta(days=3650)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OUR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_POINT_TO_POINT = ("send", "recv", "isend", "irecv")
FILE_STORE_POLL = 0.5
"""Seconds between a watcher's looks for a question in a ``FileStore``, whose blocking ``wait``
re-reads its file every 10 ms (on a shared file system, from every rank)."""


class Doing(NamedTuple):
    """Where one rank's main thread was when asked.

    Attributes:
        kind: ``"collective"``, ``"meeting"`` or ``"code"``.
        what, where: the call it is in (or function it runs), and ``file:line``
            of the user's code.
        group, members, issued: the collective's process group name, the
            global ranks it waits for, and how many the group had issued (-1:
            unknown).
        token: the same while the same call is in progress.
        ours: the library issued the collective."""

    kind: str
    what: str
    where: str
    group: str = ""
    members: tuple[int, ...] = ()
    issued: int = -1
    token: str = ""
    ours: bool = False

    def says(self) -> str:
        """One phrase for messages: ``torch.distributed.barrier() at train.py:42``."""
        return f"{self.what} at {self.where}" if self.where else self.what

    def blocks(self, rank: int) -> str:
        return f"rank {rank} is blocked in {self.says()}, which waits for this rank"

    def waits_for(self, me: int) -> bool:
        """Inside a collective that cannot finish without ``me``."""
        if self.kind != "collective" or me not in self.members:
            return False
        if self.issued < 0 or not self.group:
            return True
        try:
            mine = sequence_number(group_named(self.group))
        except (RuntimeError, AttributeError, KeyError, ValueError):
            return True  # a group this rank cannot count on
        return mine < self.issued


def ask(rank: int) -> int:
    """Ask ``rank``'s watcher; the number for :func:`answer`."""
    store = default_store()
    number = store.add(f"{_PREFIX}/{rank}/asked", 1)
    store.set(f"{_PREFIX}/{rank}/ask/{number}", str(dist.get_rank()))
    return number


def answer(rank: int, number: int) -> Optional[Doing]:
    """``rank``'s answer to question ``number`` (read once), or ``None``."""
    store = default_store()
    key = f"{_PREFIX}/{rank}/said/{number}"
    if not store.check([key]):
        return None
    fields = json.loads(store.get(key).decode())
    store.delete_key(key)
    return Doing(*fields[:4], tuple(fields[4]), *fields[5:])


class _Watcher:
    """Answers question ``n`` (``ask/n``) with ``said/n``; asleep in the store's ``wait``
    in between, or looking every :data:`FILE_STORE_POLL` s on a ``FileStore``."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.listen: dist.Store = store.clone()  # a client of its own, blocked in wait
        self.tell: dist.Store = store.clone()
        self.rank: int = rank
        self.thread: threading.Thread = threading.Thread(
            target=self._serve, name="fsdp_compose-whereabouts", daemon=True)

    def _serve(self) -> None:
        store, mine = self.listen, f"{_PREFIX}/{self.rank}"
        polls = is_file_store(store)
        try:
            number = store.add(f"{mine}/asked", 0) + 1  # earlier questions are not answered
            while True:
                key = f"{mine}/ask/{number}"
                if polls:
                    while not store.check([key]):
                        time.sleep(FILE_STORE_POLL)
                else:
                    store.wait([key], _FOREVER)
                question = store.get(key).decode()
                store.delete_key(key)
                if question == _STOP:
                    return
                store.set(f"{mine}/said/{number}", json.dumps(list(main_thread_doing())))
                number += 1
        except Exception:  # noqa: BLE001 - the store went away (the job ends): nothing to tell
            return

    def stop(self) -> None:
        try:
            number = self.tell.add(f"{_PREFIX}/{self.rank}/asked", 1)
            self.tell.set(f"{_PREFIX}/{self.rank}/ask/{number}", _STOP)
        except Exception:  # noqa: BLE001 - the store is gone: the thread has ended with it
            return
        self.thread.join(2.0)


def is_file_store(store: dist.Store) -> bool:
    """``store`` is a ``FileStore``, or a ``PrefixStore`` over one."""
    while isinstance(store, dist.PrefixStore):
        store = getattr(store, "underlying_store", None)
    return isinstance(store, dist.FileStore)


_watcher: list[_Watcher] = []


def start_watcher() -> None:
    """Start this rank's watcher once."""
    if _watcher or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    try:
        store = default_store()
    except (RuntimeError, ValueError):
        return
    watcher = _Watcher(store, dist.get_rank())
    _watcher.append(watcher)
    watcher.thread.start()
    atexit.register(watcher.stop)


def main_thread_doing() -> Doing:
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return Doing("code", "(no main thread)", "")
    user, entry, collective, meeting = None, None, None, False
    inner: list[FrameType] = []  # frames of torch and the library, innermost first
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_TORCH_DIR) or path.startswith(_OUR_DIR):
            inner.append(frame)
            name = frame.f_code.co_name
            if collective is None and (path.endswith("distributed_c10d.py") or
                                       name == "wait_watched" and path.startswith(_OUR_DIR)):
                collective = frame
            meeting = meeting or (name == "_wait_for" and path.startswith(_OUR_DIR))
        else:
            user = frame
            break
        frame = frame.f_back
    where = _location(user) if user is not None else ""
    entry = _entry(inner)
    if meeting:
        return Doing("meeting", entry, where)
    if collective is None:
        what = f"{user.f_code.co_name}()" if user is not None else entry
        return Doing("code", f"{entry} (from {what})" if inner else what, where)
    group, members = _members(collective)
    try:
        issued = sequence_number(group)
    except (RuntimeError, AttributeError):
        issued = -1
    token = f"{id(collective)}:{collective.f_lineno}:{issued}"
    ours = any(f.f_code.co_filename.startswith(_OUR_DIR) for f in inner)
    return Doing("collective", entry, where, group.group_name, members, issued, token, ours)


def _entry(inner: list[FrameType]) -> str:
    for frame in reversed(inner):
        module = frame.f_globals.get("__name__", "?")
        if module != "torch.distributed.c10d_logger":
            module = module.replace("torch.distributed.distributed_c10d", "torch.distributed")
            return f"{module}.{getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)}()"
    return "(unknown)"


def _members(frame: FrameType) -> tuple[dist.ProcessGroup, tuple[int, ...]]:
    local = frame.f_locals
    group = local.get("group", local.get("process_group")) or dist.group.WORLD
    if frame.f_code.co_name in _POINT_TO_POINT:
        peer = local.get("src", local.get("dst"))
        if isinstance(peer, int):
            return group, (peer,)
    return group, tuple(dist.get_process_group_ranks(group))


def _location(frame: FrameType) -> str:
    path = frame.f_code.co_filename
    relative = os.path.relpath(path) if os.path.isabs(path) else path
    shown = path if relative.startswith("..") else relative
    return f"{shown}:{frame.f_lineno}"
