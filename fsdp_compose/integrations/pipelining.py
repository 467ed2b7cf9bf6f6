"""Pipeline parallelism over ``fully_shard``-annotated stages: build
:class:`PipelineStage` with ``group=mesh["pp"].get_group()`` and annotate
the stage over ``mesh["dp"]``.

torch's stage drives data parallelism only for its own ``FSDPModule``,
reaching into FSDP2's internals. This stage makes the same calls through
:class:`~fsdp_compose.ShardedModule`'s public methods, except that the
step's last backward runs with sync and resharding on, so the library's own
hooks reduce the accumulated gradients.

Invariants: between steps every unit is resharded, gradients are reduced
once per step, and ``.grad`` holds the mean over micro-batches and ranks.
Only full backwards (GPipe, 1F1B, interleaved); zero-bubble schedules raise.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from .._torch_private import require_override
from ..module_methods.sharded_module import ShardedModule

# not public: a torch that renamed it would skip the override below
require_override(_TorchPipelineStage, "backward_maybe_with_nosync",
                 "fsdp_compose.integrations.pipelining.PipelineStage's gradient sync on the last backward only")


class PipelineStage(_TorchPipelineStage):
    """torch's ``PipelineStage`` (same arguments) for a ``submodule``
    annotated by :func:`fully_shard`: micro-batch backwards run without sync
    and keep the units unsharded, except the step's last, which reduces and
    reshards."""

    def __init__(self, submodule: nn.Module, *args: Any, **kwargs: Any) -> None:
        if not isinstance(submodule, ShardedModule):
            raise TypeError(
                f"fsdp_compose.integrations.pipelining.PipelineStage needs a stage module annotated by "
                f"fully_shard, got {type(submodule).__name__}: call fully_shard(stage_module, "
                "mesh=...) (after its blocks) first, or use torch's PipelineStage for a module "
                "fsdp_compose does not manage.")
        super().__init__(submodule, *args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict,
                                   last_backward: bool = False):
        if backward_type != "full":
            raise NotImplementedError(
                f"a pipeline schedule asked stage {self.stage_index} for a split backward "
                f"('{backward_type}'); fsdp_compose stages support schedules with full "
                "backwards (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B), not "
                "zero-bubble ones (the weight half would run outside the library's hooks).")
        stage: ShardedModule = self.submod  # type: ignore[assignment]
        stage.set_requires_gradient_sync(last_backward)
        stage.set_reshard_after_backward(last_backward)
        stage.set_is_last_backward(last_backward)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
