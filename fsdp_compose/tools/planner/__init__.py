"""Per-rank memory of a ``fully_shard`` annotation, planned in one process
with no process group (the model may live on ``meta``)::

    print(estimate_memory(model, world_size=8))  # every block, then the root
    units, estimate = propose_units(model, world_size=8, budget_bytes=20 * 2**30)

Each unit groups its parameters into flat buffers by ``fully_shard``'s own
setup code, then one training step is replayed ([Note: the simulated
step]).
"""

from .estimate import BACKENDS, OPTIMIZER_MOMENTS, Proposal, estimate_memory, propose_units
from .report import MemoryEstimate, PeakParts
from .units import default_units

__all__ = ["BACKENDS", "OPTIMIZER_MOMENTS", "MemoryEstimate", "PeakParts", "Proposal",
           "default_units", "estimate_memory", "propose_units"]
