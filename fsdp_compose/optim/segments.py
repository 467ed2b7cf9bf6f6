"""Stretches of a shard that the flat optimizer step updates as one tensor.

A *segment* is a stretch of one shard holding parameters of one family back
to back, its state one flat tensor per state name that each parameter's
state views. Each step cuts it into *runs* of parameters whose ``.grad`` is
a piece of one flat gradient, whose state is the segment's views (other
state is copied in: *adopted*), and of one step count. Padding between
members is stepped with them and stays zero.

Invariant: for every member ``i`` with ``installed[i]``,
``optimizer.state[param] is installed[i]``, its values view ``flats``, and
``ages[i]`` is its ``step``.
"""

from __future__ import annotations

import operator
import sys
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn as nn

from .._torch_private import optimizer_scalar_dtype, view_base
from ..buffers.flat_buffer import FlatBuffer
from .rules import Rule, RunTensors

_grad_of = operator.attrgetter("grad")

CPU_RUN_CAP = 1 << 18
"""CPU runs of several parameters stop at 2^18 elements: a for-loop step
passes over whole-run temporaries several times, fastest in cache."""


class Run(NamedTuple):
    """Members ``first``..``last``, ``numel`` elements from ``start``, all of
    age ``age`` (``-1``: no state yet)."""

    segment: "Segment"
    first: int
    last: int
    start: int
    numel: int
    age: int


class Member(NamedTuple):

    index: int
    param: nn.Parameter
    group: int


class Segment:

    def __init__(self, buffer: FlatBuffer, members: Sequence[Member]) -> None:
        slices = buffer.local_slices()
        self.buffer: FlatBuffer = buffer
        self.sharded: torch.Tensor = buffer.sharded
        """A new one after a dtype conversion: rebuild."""
        self.indices: tuple[int, ...] = tuple(m.index for m in members)
        self.params: tuple[nn.Parameter, ...] = tuple(m.param for m in members)
        self.groups: tuple[int, ...] = tuple(m.group for m in members)
        held = [slices[i] for i in self.indices if slices[i].length]
        self.shard_start: int = held[0].shard_start if held else 0
        self.numel: int = held[-1].shard_start + held[-1].length - self.shard_start if held else 0
        self.offsets: tuple[int, ...] = tuple(
            slices[i].shard_start - self.shard_start if slices[i].length else 0
            for i in self.indices)
        self.lengths: tuple[int, ...] = tuple(slices[i].length for i in self.indices)
        self.flats: dict[str, torch.Tensor] = {}
        self.installed: list[Optional[dict]] = [None] * len(self.params)
        self.ages: list[int] = [0] * len(self.params)
        self.uniform: Optional[tuple[str, ...]] = None
        """State names for which every member is installed and of one age (the
        fast path)."""
        self.cap: int = CPU_RUN_CAP if self.sharded.device.type == "cpu" else sys.maxsize
        self._whole: Optional[list[Run]] = None
        self._by_group: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {}

    def state_view(self, name: str, member: int) -> torch.Tensor:
        flat, param = self.flats[name], self.params[member]
        return flat.as_strided(param.size(), param.stride(),
                               flat.storage_offset() + self.offsets[member])

    def _allocate(self, names: Sequence[str]) -> None:
        for name in names:
            if name not in self.flats:
                self.flats[name] = torch.zeros(self.numel, dtype=self.sharded.dtype,
                                               device=self.sharded.device)

    def _adopt(self, member: int, state: dict, names: tuple[str, ...], rule: Rule,
               opt_state: dict) -> Optional[int]:
        """Copy state made elsewhere into the segment's views and install it; the
        member's age, or ``None`` (not this optimizer's: torch steps it)."""
        param = self.params[member]
        expected = set(names) | ({"step"} if rule.counts_steps else set())
        if set(state) != expected:
            return None
        step = state.get("step")
        if rule.counts_steps and not (isinstance(step, torch.Tensor) and step.dim() == 0
                                      and step.device.type == "cpu"
                                      and step.dtype == optimizer_scalar_dtype()):
            return None
        for name in names:
            value = state[name]
            if not (isinstance(value, torch.Tensor) and value.shape == param.shape
                    and value.dtype == param.dtype and value.device == param.device):
                return None
        self._allocate(names)
        new = {"step": step} if rule.counts_steps else {}
        for name in names:
            view = self.state_view(name, member)
            if state[name].data_ptr() != view.data_ptr() or state[name].stride() != view.stride():
                view.copy_(state[name])
            new[name] = view
        opt_state[param] = new
        self.installed[member] = new
        self.ages[member] = int(step.item()) if rule.counts_steps else 1
        return self.ages[member]

    def lay_first_state(self, member: int, names: tuple[str, ...], opt_state: dict) -> None:
        """Give the member torch's first-step state (zeros, ``step`` 0) as views
        of the flat state, not installed: torch's first step writes into them and
        the next flat step adopts them without a copy."""
        self._allocate(names)
        state = {"step": torch.tensor(0.0, dtype=optimizer_scalar_dtype())}
        state.update((name, self.state_view(name, member)) for name in names)
        opt_state[self.params[member]] = state

    def forget(self, member: int) -> None:
        self.installed[member] = None
        self.uniform = None

    def _grad_base(self, grads: list) -> Optional[tuple[torch.Tensor, Optional[list[bool]]]]:
        """The flat gradient the members' ``.grad`` are pieces of, and which are (``None``: all)."""
        kept = self.buffer.grad.kept_views()
        if kept is not None:
            base, views = kept
            if all(map(operator.is_, grads, map(views.__getitem__, self.indices))):
                return base, None
        first = next((g for g, n in zip(grads, self.lengths) if g is not None and n), None)
        if first is None:
            return None
        base = view_base(first)
        base = first if base is None else base
        if base.dim() != 1 or base.stride(0) != 1 or base.numel() != self.sharded.numel() or \
                base.dtype != self.sharded.dtype or base.device != self.sharded.device:
            return None  # not laid out like the shard
        shift = base.storage_offset() - self.sharded.storage_offset()
        ok = []
        for g, p, n in zip(grads, self.params, self.lengths):
            ok.append(g is not None and g.shape == p.shape and (
                n == 0 or (view_base(g) is base and g.stride() == p.stride()
                           and g.storage_offset() - p.storage_offset() == shift)))
        return base, ok

    def collect(self, rule: Rule, names: tuple[str, ...], opt_state: dict
                ) -> tuple[Optional[torch.Tensor], list[Run]]:
        """This step's runs and the flat gradient they read."""
        if self.sharded is not self.buffer.sharded:
            return None, []  # converted since the plan: the caller rebuilds
        grads = list(map(_grad_of, self.params))
        found = self._grad_base(grads)
        if found is None:
            return None, []
        base, ok = found
        states = list(map(opt_state.get, self.params))
        if ok is None and self.uniform == names and all(map(operator.is_, states, self.installed)):
            if self._whole is None:
                self._whole = self._runs([0] * len(self.params))
            age = self.ages[0]
            return base, [run._replace(age=age) for run in self._whole]
        ages: list[Optional[int]] = []
        for i, (grad, state) in enumerate(zip(grads, states)):
            age = None
            if grad is not None and (ok is None or ok[i]):
                if not names and not rule.counts_steps:
                    age = 0  # stateless (SGD without momentum)
                elif state is not None and state is self.installed[i]:
                    age = self.ages[i]
                elif not state:
                    age = -1
                else:
                    age = self._adopt(i, state, names, rule, opt_state)
            ages.append(age)
        return base, self._runs(ages)

    def _runs(self, ages: Sequence[Optional[int]]) -> list[Run]:
        """Runs by age (``None``: skipped), never over a skipped parameter nor past
        ``cap`` elements unless one parameter alone is larger."""
        runs: list[Run] = []
        current: Optional[list] = None  # [first, last, start, end, age]; start None: no elements yet
        for i, age in enumerate(ages):
            start, n = self.offsets[i], self.lengths[i]
            if age is None:  # even an empty piece
                current = self._close(current, runs)
                continue
            if current is not None and current[4] == age and \
                    (n == 0 or current[2] is None or start + n - current[2] <= self.cap):
                current[1] = i
                if n:
                    current[2] = start if current[2] is None else current[2]
                    current[3] = start + n
                continue
            current = self._close(current, runs)
            current = [i, i, start, start + n, age] if n else [i, i, None, None, age]
        self._close(current, runs)
        return runs

    def _close(self, current: Optional[list], runs: list[Run]) -> None:
        if current is not None:
            first, last, start, end, age = current
            if start is None:  # empty pieces only: state and step, no elements
                start = end = 0
            runs.append(Run(self, first, last, start, end - start, age))
        return None

    def tensors(self, run: Run, base: torch.Tensor, rule: Rule, names: tuple[str, ...]
                ) -> RunTensors:
        """The run's flat tensors; a run without state gets zeros and ``step`` 0."""
        self._allocate(names)
        at = self.shard_start + run.start
        fresh = run.age < 0
        states: dict[str, Optional[torch.Tensor]] = {}
        for name in names:
            piece = self.flats[name].narrow(0, run.start, run.numel)
            if fresh:
                if rule.fresh_state_from_grad():
                    piece = None
                else:
                    piece.zero_()  # the memory may hold a dropped state's values
            states[name] = piece
        step = None
        if rule.counts_steps:
            if fresh:
                for i in range(run.first, run.last + 1):
                    self._install(i, names, torch.tensor(0.0, dtype=optimizer_scalar_dtype()))
            step = self.installed[run.first]["step"]
        return RunTensors(self.sharded.narrow(0, at, run.numel), base.narrow(0, at, run.numel),
                          states, step)

    def values_by_group(self, run: Run) -> list[tuple[int, torch.Tensor]]:
        key = (run.first, run.last)
        pieces = self._by_group.get(key)
        if pieces is None:
            pieces, current = [], None  # current: [group, start, end]
            for i in range(run.first, run.last + 1):
                if not self.lengths[i]:
                    continue
                start, end = self.offsets[i], self.offsets[i] + self.lengths[i]
                if current is not None and current[0] == self.groups[i]:
                    current[2] = end
                    continue
                current = [self.groups[i], start, end]
                pieces.append(current)
            pieces = [(group, self.sharded.narrow(0, self.shard_start + start, end - start))
                      for group, start, end in pieces]
            self._by_group[key] = pieces
        return pieces

    def _install(self, member: int, names: tuple[str, ...], step: Optional[torch.Tensor]) -> None:
        new = {} if step is None else {"step": step}
        for name in names:
            new[name] = self.state_view(name, member)
        self.installed[member] = new
        self.ages[member] = 0

    def finish(self, run: Run, handed_back: Optional[dict], names: tuple[str, ...],
               rule: Rule, opt_state: dict, later_steps: list) -> None:
        """After the functional step: install a first step's state, count the step."""
        if run.age < 0:
            for name, value in (handed_back or {}).items():  # torch's clone of the gradient
                self.flats[name].narrow(0, run.start, run.numel).copy_(value)
            for i in range(run.first, run.last + 1):
                if not rule.counts_steps:
                    self._install(i, names, None)
                opt_state[self.params[i]] = self.installed[i]
        if names or rule.counts_steps:
            for i in range(run.first + 1, run.last + 1):
                if rule.counts_steps:
                    later_steps.append(self.installed[i]["step"])
                self.ages[i] += 1
            self.ages[run.first] += 1

    def settle(self, names: tuple[str, ...], rule: Rule) -> None:
        if not names and not rule.counts_steps:
            self.uniform = names  # stateless: every member with a gradient is stepped alike
        elif None not in self.installed and min(self.ages) == max(self.ages):
            self.uniform = names
        else:
            self.uniform = None


def build_segments(buffer: FlatBuffer, members: Sequence[Member]) -> list[Segment]:
    """Cut ``members`` into segments in shard order, a new one wherever another
    parameter lies between."""
    slices = buffer.local_slices()
    mine = {m.index: m for m in members}
    held = sorted((i for i in range(len(slices)) if slices[i].length),
                  key=lambda i: slices[i].shard_start)
    segments: list[list[Member]] = []
    current: Optional[list] = None
    for index in held:
        if index not in mine:
            current = None
            continue
        if current is None:
            current = []
            segments.append(current)
        current.append(mine[index])
    empty = [m for m in members if not slices[m.index].length]
    if empty:
        (segments[-1] if segments else segments.append([]) or segments[-1]).extend(empty)
    return [Segment(buffer, seg) for seg in segments]


def is_flat_view(buffer: FlatBuffer, index: int, param: torch.Tensor) -> bool:
    if type(param) is not nn.Parameter or not param.dtype.is_floating_point:
        return False
    s = buffer.local_slices()[index]
    sharded = buffer.sharded
    if param.dtype != sharded.dtype or param.device != sharded.device:
        return False
    if not s.length:
        return True
    return param.untyped_storage().data_ptr() == sharded.untyped_storage().data_ptr() and \
        param.storage_offset() - sharded.storage_offset() == s.shard_start


def member_ids(runs: Sequence[Run]) -> set[int]:
    return {id(run.segment.params[i]) for run in runs for i in range(run.first, run.last + 1)}

