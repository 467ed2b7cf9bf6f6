"""``ModelSettings``: the settings of a whole model, in one place.

A model-wide setter on any annotated module changes the root's settings;
before the root's lazy init the root merges them (:func:`merge_changes`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional

import torch.nn as nn

from ..policies import PrefetchPolicy
from .buckets import DEFAULT_BUCKET_CAP_MB

MAX_PENDING_REDUCES = "max_pending_reduces"
"""One field of ``prefetch_policy``, applied after a whole policy's change."""

SETTERS: dict[str, str] = {
    "prefetch_policy": "set_prefetch_policy",
    MAX_PENDING_REDUCES: "set_reduce_scatter_max_input_buffers",
    "bucket_cap_mb": "set_bucket_cap_mb",
    "is_last_backward": "set_is_last_backward",
    "manual_finalization": "set_manual_backward_finalization",
    "check_rank_divergence": "set_check_rank_divergence",
    "after_last_backward": "set_check_finite_gradients",
}
"""Every change, in the order a merge applies them, with its method."""


@dataclass(slots=True)
class ModelSettings:
    """Owned by the root's ``ModelContext``, read by reference; only
    :meth:`change` writes them (the setters' docstrings say what each means)."""

    prefetch_policy: PrefetchPolicy = field(default_factory=PrefetchPolicy)
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    is_last_backward: bool = True
    check_rank_divergence: Optional[bool] = None
    after_last_backward: Optional[Callable[[nn.Module], None]] = None
    manual_finalization: bool = False

    def change(self, name: str, value: Any) -> None:
        """One change named in :data:`SETTERS`."""
        if name == MAX_PENDING_REDUCES:
            self.prefetch_policy = dataclasses.replace(self.prefetch_policy,
                                                       max_pending_reduces=value)
        else:
            assert name in SETTERS, f"unknown model setting {name!r}"
            setattr(self, name, value)

    def change_all(self, changes: Mapping[str, object]) -> None:
        """In :data:`SETTERS` order (a whole policy before one of its fields)."""
        for name in SETTERS:
            if name in changes:
                self.change(name, changes[name])


def merge_changes(made: Iterable[tuple[str, Mapping[str, object]]], root: str) -> dict[str, object]:
    """``(unit name, changes)`` in module order, merged; one change with two
    values raises ``ValueError`` on every rank alike, before any collective."""
    chosen: dict[str, tuple[object, str]] = {}
    for unit, changes in made:
        for name, value in changes.items():
            if name in chosen and chosen[name][0] != value:
                other, before = chosen[name][1], chosen[name][0]
                raise ValueError(
                    f"{SETTERS[name]}() was called with different values on {other} "
                    f"({before!r}) and {unit} ({value!r}) before the first forward; it applies "
                    f"to the whole model. Call it once, on the root module {root}.")
            chosen.setdefault(name, (value, unit))
    return {name: value for name, (value, _) in chosen.items()}
