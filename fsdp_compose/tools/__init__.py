"""Tools around ``fully_shard``: seeing what it did, and annotating a model
by a rule.

* :func:`describe` (``describe.py``): the units, flat buffers and parameter
  assignment of an annotated model as a :class:`ModelReport`; ``print`` it
  for a table per unit, ``to_dict()`` for JSON. Local, no collectives.
* :func:`fully_shard_by` (``annotate.py``): ``fully_shard`` every module a
  class or predicate matches, bottom-up, then the model itself.
* :func:`estimate_memory` / :func:`propose_units` (``planner.py``): per-rank
  memory of an annotation planned on a ``meta`` model with no process
  group, and an annotation that fits a budget.
* :func:`fully_shard_root` (``split_root.py``): the root, its leftover
  parameters split into the units where they are used (embeddings, head).
* :class:`ShardedMemTracker` (``mem_tracker.py``): torch's ``MemTracker``
  that also runs on ``fully_shard`` models.
"""

from .annotate import fully_shard_by
from .split_root import fully_shard_root
from .describe import BufferReport, ModelReport, ParamReport, Totals, UnitReport, describe
from .planner import MemoryEstimate, Proposal, estimate_memory, propose_units

__all__ = ["describe", "fully_shard_by", "ModelReport", "UnitReport", "BufferReport",
           "ParamReport", "Totals", "estimate_memory", "propose_units", "MemoryEstimate",
           "Proposal", "ShardedMemTracker", "fully_shard_root"]


def __getattr__(name: str):
    # ShardedMemTracker subclasses torch's MemTracker, whose import brings in
    # torch._inductor and torch._dynamo: imported when first asked for
    if name == "ShardedMemTracker":
        from .mem_tracker import ShardedMemTracker
        return ShardedMemTracker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
