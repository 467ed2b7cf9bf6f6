"""``fsdp_compose.pipelining``, the documented import path of
:class:`PipelineStage` (torch's pipeline stage for a stage module annotated
by ``fully_shard``); the code is ``integrations/pipelining.py``."""

from .integrations.pipelining import PipelineStage

__all__ = ["PipelineStage"]
