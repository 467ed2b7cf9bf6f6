"""Crash-safe checkpoint directories on top of ``torch.distributed.checkpoint``::

    store = CheckpointStore("ckpt", keep=2)
    start = store.load_latest(state) or 0     # None when there is no checkpoint
    for step in range(start + 1, steps + 1):
        ...
        if step % save_every == 0:
            store.save(step, state)

``root/step_<8 digits>/`` are committed DCP checkpoints, ``latest`` names
the newest (for humans), anything else is garbage deleted after the next
save. Invariant, whenever a rank is killed: a directory named
``step_<N>`` is complete (fsynced before one atomic rename) and never
modified afterwards. Assumes a file system every rank sees and one job
writing to it.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from .._torch_private import local_tensor
from ..comm.rendezvous import arrive
from ._lazy import LazyChunk
from ._pieces import ShardPieces
from .flat import FlatLoadPlanner, FlatSavePlanner

__all__ = ["CheckpointStore", "CheckpointError"]

_STEP_RE = re.compile(r"^step_(\d{8,})$")
_METADATA = ".metadata"
_MANIFEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint could not be loaded (missing, torn or mismatched); raised on
    every rank alike, naming the directory and each failing rank's reason."""


class CheckpointStore:
    """Atomic, rotating DCP checkpoints of a run under ``root``.

    ``keep`` (>= 1): committed checkpoints retained. ``group``: the process
    group of the collective calls (default: the default group).
    ``async_save``: ``save`` returns once ``state`` is staged in host memory
    and commits in a background thread over a gloo group of its own (the
    constructor is then collective); the next ``save``, ``load*`` or
    :meth:`wait` waits for it and raises its error."""

    def __init__(self, root: Union[str, os.PathLike], keep: int = 2, *,
                 group: Optional[dist.ProcessGroup] = None, async_save: bool = False) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.group = group
        self.async_save = async_save
        self._save_group: Optional[dist.ProcessGroup] = group
        """``group``, or for async saves a gloo group of the same ranks."""
        if async_save and self._distributed():
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            self._save_group = dist.new_group(ranks, backend="gloo")
        self._in_flight: Optional[threading.Thread] = None
        self._in_flight_error: Optional[BaseException] = None

    def path(self, step: int) -> Path:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.root / f"step_{step:08d}"

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            m = _STEP_RE.match(entry.name)
            if m and entry.is_dir():
                found.append(int(m.group(1)))
        return sorted(found)

    def latest_step(self) -> Optional[int]:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Save ``state`` as checkpoint ``step``; collective. Commits by renaming a
        ``.partial-*`` directory once complete, then deletes old checkpoints;
        ``CheckpointError`` on every rank if the commit failed. Returns the
        committed path (``async_save``: once :meth:`wait` returns)."""
        self._arrive("CheckpointStore.save")
        self.wait()
        if not self.async_save:
            return self._save_now(step, state)
        staged = _staged(state)
        self._in_flight_error = None
        self._in_flight = threading.Thread(target=self._save_in_background, args=(step, staged),
                                           name=f"CheckpointStore.save({step})", daemon=True)
        self._in_flight.start()
        return self.path(step)

    def wait(self) -> None:
        """Wait for the async save in flight and raise its error. Call it before the job ends."""
        thread, self._in_flight = self._in_flight, None
        if thread is not None:
            thread.join()
        error, self._in_flight_error = self._in_flight_error, None
        if error is not None:
            raise error

    def _save_in_background(self, step: int, staged: dict[str, Any]) -> None:
        try:
            self._save_now(step, staged)
        except BaseException as e:
            self._in_flight_error = e

    def _save_now(self, step: int, state: dict[str, Any]) -> Path:
        group = self._save_group
        final = self.path(step)
        rank = self._rank()
        name = [f"{final.name}.partial-{uuid.uuid4().hex[:12]}" if rank == 0 else None]
        if self._distributed():
            dist.broadcast_object_list(name, src=self._global_rank0(), group=group)
        partial = self.root / name[0]
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        dcp.save(state, checkpoint_id=partial, process_group=group, planner=FlatSavePlanner())
        self._barrier(group)
        problem, error = None, None
        if rank == 0:
            try:
                self._commit(step, partial, final)
            except Exception as e:
                problem, error = _describe(e), e
        # doubles as the closing barrier
        self._raise_if_any(final, f"was not committed (its files are in {partial.name})",
                           problem, error, group=group)
        return final

    def load_latest(self, state: dict[str, Any]) -> Optional[int]:
        """Load the newest committed checkpoint into ``state`` in place;
        collective. Returns its step, or ``None`` when there is none.
        ``CheckpointError`` on every rank if it is torn or does not match
        ``state`` (no fallback to an older one)."""
        self._arrive("CheckpointStore.load_latest")
        self.wait()
        step = [self.latest_step() if self._rank() == 0 else None]
        if self._distributed():
            dist.broadcast_object_list(step, src=self._global_rank0(), group=self.group)
        if step[0] is None:
            return None
        self._load(step[0], state)
        return step[0]

    def load(self, step: int, state: dict[str, Any]) -> None:
        """Load committed checkpoint ``step`` into ``state`` in place; collective.
        ``CheckpointError`` on every rank if it is missing, torn or mismatched."""
        self._arrive("CheckpointStore.load")
        self.wait()
        self._load(step, state)

    def _load(self, step: int, state: dict[str, Any]) -> None:
        path = self.path(step)
        problem = None
        if not path.is_dir():
            problem = "the directory does not exist"
        elif not (path / _METADATA).is_file():
            problem = (f"it has no {_METADATA} file (torn checkpoint: its writing did not "
                       f"finish, or files were deleted since)")
        self._raise_if_any(path, "is not loadable", problem)
        problem, error = None, None
        try:
            dcp.load(state, checkpoint_id=path, process_group=self.group,
                     planner=FlatLoadPlanner())
        except CheckpointException as e:
            problem, error = {r: _describe(exc) for r, (exc, _) in e.failures.items()}, e
        except Exception as e:
            problem, error = _describe(e), e
        self._raise_if_any(path, "could not be loaded into the given state", problem, error)

    def _arrive(self, call: str) -> None:
        """[Note: call rendezvous]"""
        if self._distributed():
            arrive(self.group, call, "Call it on every rank (each writes or reads its own "
                   "shards); guard only printing or logging with `if rank == 0:`.")

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _rank(self) -> int:
        return dist.get_rank(self.group) if self._distributed() else 0

    def _global_rank0(self) -> int:
        if self.group is None:
            return 0
        return dist.get_global_rank(self.group, 0)

    def _barrier(self, group: Optional[dist.ProcessGroup]) -> None:
        if self._distributed():
            dist.barrier(group=group)

    def _raise_if_any(self, path: Path, what: str, problem: Union[None, str, dict[int, str]],
                      error: Optional[BaseException] = None, *,
                      group: Optional[dist.ProcessGroup] = None) -> None:
        """Raise the same ``CheckpointError`` on every rank if any rank has a ``problem``."""
        group = group if group is not None else self.group
        if self._distributed():
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, problem, group=group)
        else:
            gathered = [problem]
        by_rank: dict[int, str] = {}
        for rank, p in enumerate(gathered):
            if isinstance(p, dict):
                by_rank.update(p)
            elif p is not None:
                by_rank[rank] = p
        if not by_rank:
            return
        ranks_of: dict[str, list[int]] = {}
        for rank in sorted(by_rank):
            ranks_of.setdefault(by_rank[rank], []).append(rank)
        lines = [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {text}"
                 for text, r in ranks_of.items()]
        detail = lines[0] if len(lines) == 1 else "\n  " + "\n  ".join(lines)
        raise CheckpointError(f"checkpoint {path} {what}: {detail}") from error

    def _commit(self, step: int, partial: Path, final: Path) -> None:
        if not (partial / _METADATA).is_file():
            raise FileNotFoundError(f"dcp.save did not write {partial / _METADATA}")
        if final.exists():
            os.replace(final, self.root / f"{final.name}.replaced-{uuid.uuid4().hex[:12]}")
        os.replace(partial, final)
        _fsync_dir(self.root)
        self._write_manifest(step)
        self._collect_garbage(step)

    def _write_manifest(self, step: int) -> None:
        tmp = self.root / f"{_MANIFEST}.tmp-{uuid.uuid4().hex[:12]}"
        with open(tmp, "w") as f:
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / _MANIFEST)
        _fsync_dir(self.root)

    def _collect_garbage(self, saved: int) -> None:
        others = [s for s in self.steps() if s != saved]
        for old in sorted(others, reverse=True)[self.keep - 1:]:
            # renamed first: a crash mid-deletion leaves garbage, not a torn step
            path = self.path(old)
            os.replace(path, path.with_name(f"{path.name}.deleting-{uuid.uuid4().hex[:12]}"))
        for entry in self.root.iterdir():
            if entry.name.startswith("step_") and any(
                    tag in entry.name for tag in (".partial-", ".replaced-", ".deleting-")):
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.startswith(f"{_MANIFEST}.tmp-"):
                entry.unlink(missing_ok=True)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _staged(state: Any) -> Any:
    """A copy of ``state`` training cannot change, for an async save."""
    if isinstance(state, Stateful) and not isinstance(state, torch.Tensor):
        return _staged(state.state_dict())
    if isinstance(state, dict):
        return {key: _staged(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_staged(value) for value in state)
    if isinstance(state, DTensor) and isinstance(local_tensor(state), LazyChunk) and \
            not local_tensor(state).materialized:
        return local_tensor(state).staged(state, _host_copy)
    if isinstance(state, DTensor):
        return DTensor.from_local(_host_copy(state.to_local()), state.device_mesh,
                                  state.placements, run_check=False, shape=state.shape,
                                  stride=state.stride())
    if isinstance(state, ShardPieces):
        return state.staged(_host_copy)
    if isinstance(state, torch.Tensor):
        return _host_copy(state)
    return copy.deepcopy(state)


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    out = torch.empty_like(tensor, device="cpu", pin_memory=tensor.device.type != "cpu")
    return out.copy_(tensor)
