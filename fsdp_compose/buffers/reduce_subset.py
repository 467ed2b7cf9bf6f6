"""Reducing only the parameters that train, when a buffer also holds frozen ones.

[Note: reducing a subset of a buffer]
Buffers group parameters by ``requires_grad`` *at annotation*; a parameter
frozen later (progressive unfreezing, LoRA after ``fully_shard``) stays in
its trainable buffer, and reducing the whole flat gradient would move its
zeros. So when some parameters of a trainable buffer do not train, the
reduce-scatter moves a *packed* gradient: for each rank ``r``, the positions
of its shard ``[r*S, (r+1)*S)`` that belong to a training parameter, in
order, zero-padded to the longest rank's count ``T``; each rank spreads its
reduced ``T`` back over its shard (zeros elsewhere). Sizes depend only on
the layout and the flags, equal on every rank, so all issue the same
collective. A parameter trains if it trained at any forward since the last
reduction (a flag changed within an accumulation window keeps its gradient).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .layout import FlatLayout

_WORTH_PACKING = 0.75
"""Pack only if the packed collective is at most this fraction of the
whole (the packing and spreading copies cost more than they save above)."""


Ranges = tuple[tuple[int, int], ...]
"""``(start, length)`` runs of positions, in increasing order."""


class ReduceSubset:
    """Which positions of a buffer's flat gradient a reduce-scatter moves
    when only some of its parameters train (see [Note: reducing a subset of
    a buffer]).

    Invariant: ``runs[r]`` are rank ``r``'s training positions (in the
    padded flat buffer), ``chunk`` the longest rank's count; the packed
    gradient is each rank's runs then zeros up to ``chunk``, rank-major."""

    def __init__(self, layout: FlatLayout, runs: Sequence[Ranges], rank: int) -> None:
        self.chunk: int = max(sum(n for _, n in r) for r in runs)
        self._runs: tuple[Ranges, ...] = tuple(runs)
        shard = layout.shard_numel
        self._local: Ranges = tuple((start - rank * shard, n) for start, n in runs[rank])
        self._shard_numel: int = shard

    def pack(self, flat: torch.Tensor) -> torch.Tensor:
        """The ``world * chunk`` elements of ``flat`` (padded numel) to
        reduce, in one concatenation."""
        parts: list[torch.Tensor] = []
        for runs in self._runs:
            parts.extend(flat.narrow(0, start, n) for start, n in runs)
            padding = self.chunk - sum(n for _, n in runs)
            if padding:
                parts.append(flat.new_zeros(padding))
        return torch.cat(parts)

    def spread(self, reduced: torch.Tensor) -> torch.Tensor:
        """This rank's reduced ``chunk`` as a whole shard (zeros where
        nothing trains)."""
        shard = reduced.new_zeros(self._shard_numel)
        offset = 0
        for start, n in self._local:
            shard.narrow(0, start, n).copy_(reduced.narrow(0, offset, n))
            offset += n
        return shard


def plan_subset(layout: FlatLayout, training: Sequence[bool], rank: int) -> Optional[ReduceSubset]:
    """The packed reduction for these flags, or ``None`` where the whole
    flat gradient should be reduced (every parameter trains, or packing
    would save too little)."""
    if all(training):
        return None
    runs = [_training_runs(layout, training, r) for r in range(layout.world_size)]
    chunk = max(sum(n for _, n in r) for r in runs)
    if chunk == 0 or chunk > _WORTH_PACKING * layout.shard_numel:
        return None
    return ReduceSubset(layout, runs, rank)


def _training_runs(layout: FlatLayout, training: Sequence[bool], rank: int) -> Ranges:
    """The runs of rank ``rank``'s shard that belong to parameters that
    train, in increasing order, adjacent runs merged."""
    lo, hi = layout.shard_range(rank)
    runs: list[tuple[int, int]] = []
    for segment in layout.segments():
        if segment.param_index < 0 or not training[segment.param_index]:
            continue
        start, end = max(segment.start, lo), min(segment.start + segment.length, hi)
        if end <= start:
            continue
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + end - start)
        else:
            runs.append((start, end - start))
    return tuple(runs)


class SubsetPlans(dict[tuple[bool, ...], Optional[ReduceSubset]]):
    """:func:`plan_subset` per tuple of training flags, planned on the first
    lookup (``plans[flags]``; ``None``: the whole shard). A ``dict``
    subclass, so a lookup that finds its plan runs no Python call."""

    __slots__ = ("layout", "rank")

    def __init__(self, layout: FlatLayout, rank: int) -> None:
        super().__init__()
        self.layout: FlatLayout = layout
        self.rank: int = rank

    def __missing__(self, training: tuple[bool, ...]) -> Optional[ReduceSubset]:
        plan = self[training] = plan_subset(self.layout, training, self.rank)
        return plan
