"""Pipeline parallelism over ``fully_shard``-annotated stages:
:class:`PipelineStage`, torch's ``torch.distributed.pipelining.PipelineStage``
for a stage module annotated by :func:`fully_shard`.

Usage (4 ranks: 2 pipeline stages x 2-way data parallel)::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage_index = mesh["pp"].get_local_rank()
    stage_module = build_stage(stage_index)                    # this rank's layers
    for block in stage_module.blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(stage_module, mesh=mesh["dp"])
    stage = PipelineStage(stage_module, stage_index, 2, torch.device("cpu"),
                          group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)  # or Schedule1F1B

Why a subclass: torch's stage drives data parallelism only for torch's own
``FSDPModule`` (and DDP): before each micro-batch's backward it calls
``set_is_last_backward(False)``, ``set_reshard_after_backward(False)`` and
``set_requires_gradient_sync(False)``, and after the last one it reaches
into FSDP2's internals (``fully_shard.state(m)._state_ctx.all_states``,
``_fsdp_param_groups[i].post_backward()``,
``_root_post_backward_final_callback()``) to reduce the accumulated
gradients outside any backward. An annotated module is not an
``FSDPModule`` and has none of those internals, so torch's stage would run
every micro-batch's backward with gradient sync (one reduce-scatter per
unit per micro-batch). This stage makes the same three calls through
:class:`~fsdp_compose.ShardedModule`'s public methods instead, with one
difference: the schedule tells each backward whether it is the step's last
(``last_backward``), and that backward runs with sync, resharding and the
end-of-backward publication on, so the accumulated gradients are reduced
by the library's own post-backward hooks (nothing to do afterwards but
torch's ``scale_grads``).

Invariants: between steps every unit of the stage is resharded, gradients
are reduced once per step (the last micro-batch), and ``.grad`` holds the
mean over micro-batches (torch's ``scale_grads``) and data-parallel ranks.
Only full backwards are supported (``GPipe``, ``1F1B``, interleaved
schedules); zero-bubble schedules that split a backward into input and
weight parts raise.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from .._torch_private import require_override
from ..module_methods.sharded_module import ShardedModule

# PipelineStage.backward_maybe_with_nosync is not public: a torch that renamed it
# would skip the override below (and reduce every micro-batch's gradients)
require_override(_TorchPipelineStage, "backward_maybe_with_nosync",
                 "fsdp_compose.integrations.pipelining.PipelineStage's gradient sync on the last backward only")


class PipelineStage(_TorchPipelineStage):
    """torch's ``PipelineStage`` (same arguments) for a ``submodule``
    annotated by :func:`fully_shard`: each micro-batch's backward runs
    without gradient sync and keeps the stage's units unsharded, except the
    schedule's last backward of the step, which reduces the accumulated
    gradients and reshards."""

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
