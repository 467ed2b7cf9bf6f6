"""The public placement objects that ``fully_shard``'s ``placement`` and
``shard_placement_fn`` accept besides the strings ``"rows"``, ``"flat"`` and
``"owned"`` and torch's ``Shard(d)`` (docs/placements.md): :class:`Blocks`
and :class:`OnMesh`. Plain values: nothing here shards anything; the layout
math is ``buffers/layout.py``'s, the grouping ``setup/units.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Blocks", "OnMesh"]


@dataclass(frozen=True)
class Blocks:
    """Like ``"rows"``, in multiples of ``n`` rows (block-wise quantization:
    a rank boundary never splits a block of ``n`` rows).

    Attributes:
        n: rows per block, at least 1.
    """

    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"Blocks(n) needs an integer n >= 1, got {self.n!r}")


class OnMesh(NamedTuple):
    """What ``shard_placement_fn`` returns to shard a parameter over another
    mesh than its unit's (e.g. routed experts over the expert-data-parallel
    mesh while the rest of the block uses the data-parallel one): the
    parameter gets a flat buffer of its own mesh, whose all-gathers and
    reduce-scatters run on that mesh's group (FSDP2's
    ``ShardPlacementResult(placement, mesh_info)``, which is accepted too).

    Attributes:
        mesh: a 1-D mesh (full sharding) or a 2-D (replicate, shard) mesh.
        placement: its placement on that mesh (``None``: the unit's).
    """

    mesh: DeviceMesh
    placement: object = None
