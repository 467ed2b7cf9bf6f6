"""Reducing only the parameters that train, when a buffer also holds frozen ones.

[Note: reducing a subset of a buffer]
A parameter frozen after annotation stays in its trainable buffer. Rather
than moving its zeros, the reduce-scatter moves a *packed* gradient: each
rank's training positions, zero-padded to the longest rank's count, spread
back over the shard after. Sizes depend only on the layout and the flags,
so every rank issues the same collective. A parameter trains if it trained
at any forward since the last reduction.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .layout import FlatLayout

_WORTH_PACKING = 0.75
"""Pack only where the packed collective is at most this fraction of the whole."""


Ranges = tuple[tuple[int, int], ...]


class ReduceSubset:
    """Which positions of a flat gradient a reduce-scatter moves: each rank's
    runs then zeros up to ``chunk``, rank-major."""

    def __init__(self, layout: FlatLayout, runs: Sequence[Ranges], rank: int) -> None:
        self.chunk: int = max(sum(n for _, n in r) for r in runs)
        self._runs: tuple[Ranges, ...] = tuple(runs)
        shard = layout.shard_numel
        self._local: Ranges = tuple((start - rank * shard, n) for start, n in runs[rank])
        self._shard_numel: int = shard

    def pack(self, flat: torch.Tensor) -> torch.Tensor:
        parts: list[torch.Tensor] = []
        for runs in self._runs:
            parts.extend(flat.narrow(0, start, n) for start, n in runs)
            padding = self.chunk - sum(n for _, n in runs)
            if padding:
                parts.append(flat.new_zeros(padding))
        return torch.cat(parts)

    def spread(self, reduced: torch.Tensor) -> torch.Tensor:
        """This rank's reduced ``chunk`` as a whole shard (zeros where nothing trains)."""
        shard = reduced.new_zeros(self._shard_numel)
        offset = 0
        for start, n in self._local:
            shard.narrow(0, start, n).copy_(reduced.narrow(0, offset, n))
            offset += n
        return shard


def plan_subset(layout: FlatLayout, training: Sequence[bool], rank: int) -> Optional[ReduceSubset]:
    """The packed reduction for these flags (``None``: reduce the whole flat gradient)."""
    if all(training):
        return None
    runs = [_training_runs(layout, training, r) for r in range(layout.world_size)]
    chunk = max(sum(n for _, n in r) for r in runs)
    if chunk == 0 or chunk > _WORTH_PACKING * layout.shard_numel:
        return None
    return ReduceSubset(layout, runs, rank)


def _training_runs(layout: FlatLayout, training: Sequence[bool], rank: int) -> Ranges:
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
    """:func:`plan_subset` per tuple of flags, planned on first lookup (a
    ``dict``: a hit runs no Python)."""

    __slots__ = ("layout", "rank")

    def __init__(self, layout: FlatLayout, rank: int) -> None:
        super().__init__()
        self.layout: FlatLayout = layout
        self.rank: int = rank

    def __missing__(self, training: tuple[bool, ...]) -> Optional[ReduceSubset]:
        plan = self[training] = plan_subset(self.layout, training, self.rank)
        return plan
