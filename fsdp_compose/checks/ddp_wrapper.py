"""Refuse ``DistributedDataParallel`` around a module annotated by
``fully_shard`` (DDP would all-reduce the shards again), from the
attribute DDP's constructor reads first, on every rank before any
collective.
"""

from __future__ import annotations

import torch.nn as nn


def ddp_around_annotated(module: nn.Module) -> TypeError:
    """The error for ``DistributedDataParallel(module)``."""
    return TypeError(
        f"fsdp_compose: DistributedDataParallel (or a framework that wraps the model in it) got "
        f"{type(module).__name__}, a module annotated by fully_shard: its parameters are this "
        "rank's shards, which DDP would broadcast and all-reduce as replicas, and fully_shard "
        "reduces the gradients itself. Train it without DDP: under Hugging Face's Trainer or "
        "TRL's, use fsdp_compose.integrations.hf.ShardedTrainer or put ShardedTrainerMixin in "
        "front of the trainer class (class ShardedSFTTrainer(ShardedTrainerMixin, SFTTrainer)); "
        "under Lightning, fsdp_compose.integrations.lightning's ModelParallelStrategy.")
