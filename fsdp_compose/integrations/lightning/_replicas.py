"""Lightning's default mesh puts every device on ``"tensor_parallel"``, so
sharding over ``"data_parallel"`` would silently train one replica per
rank; this check refuses it.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ...runtime.state import units_below


def check_ranks_synchronise(module: nn.Module) -> None:
    """Raise on every rank if ``module`` has units, the job several ranks, and
    no parameter is sharded, replicated or tensor-parallel over several."""
    units = units_below(module)
    if not units or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if any(isinstance(p, DTensor) for p in module.parameters()):
        return  # tensor parallelism outside the units
    for unit in units:
        for buffer in unit.buffers:
            for record in buffer.records:
                group = record.group or unit.group
                if group.total_size > 1 or record.tp is not None:
                    return
    raise ValueError(
        f"Every one of the {dist.get_world_size()} ranks would train its own copy of the model: "
        f"each unit (e.g. {units[0].name}) shards over a mesh of one rank and nothing is tensor-"
        "parallel. Lightning's ModelParallelStrategy puts every device on 'tensor_parallel' by "
        "default; for data parallelism pass data_parallel_size=<number of devices>, "
        "tensor_parallel_size=1 and shard over device_mesh['data_parallel'].")
