"""Tools around ``fully_shard``: :func:`describe`, :func:`fully_shard_by`,
:func:`estimate_memory`, :func:`propose_units`, :func:`fully_shard_root`,
:class:`ShardedMemTracker`.
"""

from .annotate import fully_shard_by
from .split_root import fully_shard_root
from .describe import BufferReport, ModelReport, ParamReport, Totals, UnitReport, describe
from .planner import MemoryEstimate, Proposal, estimate_memory, propose_units

__all__ = ["describe", "fully_shard_by", "ModelReport", "UnitReport", "BufferReport",
           "ParamReport", "Totals", "estimate_memory", "propose_units", "MemoryEstimate",
           "Proposal", "ShardedMemTracker", "fully_shard_root"]


def __getattr__(name: str):
    # imported when first asked for: torch's MemTracker brings in torch._inductor
    if name == "ShardedMemTracker":
        from .mem_tracker import ShardedMemTracker
        return ShardedMemTracker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
