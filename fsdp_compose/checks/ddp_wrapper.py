"""Refuse ``DistributedDataParallel`` around a module annotated by
``fully_shard``.

The parameters of an annotated module are this rank's shards: DDP would
check their shapes across ranks, broadcast rank 0's rows over the others'
and all-reduce gradients that the units' hooks already reduce. Where DDP
comes from a framework (accelerate wraps every multi-process model that it
does not shard itself, so a plain Hugging Face ``Trainer`` does), the
failure was DDP's own shape mismatch on one rank and a closed connection on
the others.

The hook point is the attribute DDP's constructor reads first, on every
rank and before any collective: ``_ddp_params_and_buffers_to_ignore``
(``ShardedModule`` defines it as a property that raises this error). Nothing
global is patched; DDP around an unannotated submodule is untouched.
"""

from __future__ import annotations

import torch.nn as nn


def ddp_around_annotated(module: nn.Module) -> TypeError:
    """The error for ``DistributedDataParallel(module)`` (raised on every
    rank: each constructs its own wrapper)."""
    return TypeError(
        f"fsdp_compose: DistributedDataParallel (or a framework that wraps the model in it) got "
        f"{type(module).__name__}, a module annotated by fully_shard: its parameters are this "
        "rank's shards, which DDP would broadcast and all-reduce as replicas, and fully_shard "
        "reduces the gradients itself. Train it without DDP: under Hugging Face's Trainer or "
        "TRL's, use fsdp_compose.integrations.hf.ShardedTrainer or put ShardedTrainerMixin in "
        "front of the trainer class (class ShardedSFTTrainer(ShardedTrainerMixin, SFTTrainer)); "
        "under Lightning, fsdp_compose.integrations.lightning's ModelParallelStrategy.")
