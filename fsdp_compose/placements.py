"""Placement objects for ``fully_shard`` (docs/placements.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Blocks", "OnMesh"]


@dataclass(frozen=True)
class Blocks:
    """Like ``"rows"``, in multiples of ``n`` rows (no rank boundary splits a block).

    Attributes:
        n: rows per block, at least 1.
    """

    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"Blocks(n) needs an integer n >= 1, got {self.n!r}")


class OnMesh(NamedTuple):
    """What ``shard_placement_fn`` returns to shard a parameter over another
    mesh than its unit's, in a flat buffer of its own (as FSDP2's
    ``ShardPlacementResult``).

    Attributes:
        mesh: a 1-D mesh or a 2-D (replicate, shard) mesh.
        placement: its placement there (``None``: the unit's).
    """

    mesh: DeviceMesh
    placement: object = None
