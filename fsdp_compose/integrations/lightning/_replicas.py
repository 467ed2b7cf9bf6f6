"""The check that a model set up by Lightning's ``ModelParallelStrategy``
synchronises across its ranks.

Lightning's default mesh sizes put every device on ``"tensor_parallel"``
(``data_parallel_size=1``). A ``parallelize_fn`` / ``configure_model`` that
then shards over ``device_mesh["data_parallel"]`` and applies no tensor
parallelism gives every rank its own copy of every parameter, reduced over
one rank: each rank trains an independent replica on its own batches, with
no error, under FSDP2 as under fsdp_compose.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ...runtime.state import units_below


def check_ranks_synchronise(module: nn.Module) -> None:
    """Raise (on every rank: each computes the same answer) if ``module``
    has fsdp_compose units, the job has several ranks, and no parameter is
    sharded, replicated or tensor-parallel over more than one rank."""
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
