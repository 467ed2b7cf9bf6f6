"""Hugging Face's ``Trainer`` training a model annotated by ``fully_shard``.

Outside FSDP and DeepSpeed, accelerate wraps every multi-process model in
``DistributedDataParallel``, and the Trainer saves the model and the
optimizer from rank 0 alone. On an fsdp_compose model both are wrong: each
rank holds different rows of every parameter (DDP would all-reduce and
broadcast unrelated shards) and of the optimizer state. The mixin keeps the
Trainer's loop, logging, data loading and file layout, and changes only
what touches the shards:

* the model is handed to accelerate already prepared (no DDP wrapper; the
  gradients are reduce-scattered by the units' own hooks);
* gradient accumulation skips the reduction on the micro-batches before the
  last (accelerate's ``no_sync`` finds the root's ``no_sync``);
* clipping and the logged gradient norm need nothing: the Trainer calls
  ``torch.nn.utils.clip_grad_norm_``, which fsdp_compose routes to the norm
  over all ranks (``gradients/torch_norms.py``);
* ``save_model`` gathers full tensors on every rank (trainable ones only for
  a PEFT model) and rank 0 writes them with ``save_pretrained``: a
  ``model.safetensors`` or a PEFT adapter, in the usual format;
* the optimizer state of a checkpoint is a torch.distributed.checkpoint
  directory ``optimizer/`` (each rank writes its shard; keyed by parameter
  name); the scheduler, RNG and trainer state are the Trainer's files.

Resuming reads the model's weights through the Trainer's own code (full
tensors into ``load_state_dict``, which fsdp_compose's hooks slice into the
shards) and the optimizer from ``optimizer/``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from transformers import Trainer

from ...sharded_module import ShardedModule

OPTIMIZER_DIR = "optimizer"
"""The checkpoint's subdirectory holding the sharded optimizer state."""
SCHEDULER_FILE = "scheduler.pt"
"""The Trainer's name for the learning-rate scheduler's state."""

_OVERRIDDEN = ("_wrap_model", "save_model", "_save", "_save_optimizer_and_scheduler",
               "_load_optimizer_and_scheduler")
"""The Trainer methods the mixin overrides or calls: checked at construction,
so a transformers release that renames one fails loudly instead of
silently saving rank 0's shards."""

_FIX = ("Annotate the model with fsdp_compose.fully_shard (its layers, then the root) before "
        "building the trainer.")


class ShardedTrainerMixin:
    """Put in front of ``transformers.Trainer`` or a subclass of it
    (``class MyTrainer(ShardedTrainerMixin, SFTTrainer)``); the model passed
    to the trainer must already be annotated by ``fully_shard``, its root
    included. Mixed precision comes from ``fully_shard``'s ``mp_policy``:
    ``TrainingArguments(bf16=True / fp16=True)`` is refused (accelerate adds
    its autocast while preparing the model, which the mixin skips: the run
    would be fp32 without a word)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        missing = [name for name in _OVERRIDDEN if not hasattr(Trainer, name)]
        if missing:
            raise RuntimeError(f"{type(self).__name__} overrides Trainer.{', Trainer.'.join(missing)}, "
                               "which this transformers release lacks; install the tested range "
                               "(pip install 'fsdp_compose[hf]').")
        # checked before Trainer.__init__, which fixes accelerate's process-wide state
        _check_model(type(self).__name__, kwargs.get("model", args[0] if args else None))
        _check_precision(type(self).__name__, kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            raise ValueError(f"{type(self).__name__} shards with fsdp_compose: turn off accelerate's "
                             "FSDP / DeepSpeed (TrainingArguments fsdp=..., deepspeed=...).")

    # ------------------------------------------------------------ training
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        # accelerate skips what it has prepared: no DistributedDataParallel around the shards
        model._is_accelerate_prepared = True
        return model

    # ---------------------------------------------------------- checkpoints
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Every rank gathers; rank 0 writes ``save_pretrained``'s files (the
        adapters only, for a PEFT model)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        options = StateDictOptions(full_state_dict=True, cpu_offload=True,
                                   ignore_frozen_params=_is_peft(self.model))
        state_dict = get_model_state_dict(self.model, options=options)
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        optimizer = _unwrapped(self.optimizer)
        state = {"optimizer": get_optimizer_state_dict(self.model, optimizer)}
        dcp.save(state, checkpoint_id=os.path.join(output_dir, OPTIMIZER_DIR))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        directory = os.path.join(checkpoint, OPTIMIZER_DIR)
        if not os.path.isdir(directory):
            raise FileNotFoundError(
                f"resume_from_checkpoint={checkpoint!r} has no {OPTIMIZER_DIR}/ directory: it was not "
                f"written by {type(self).__name__} (a plain Trainer saves rank 0's optimizer only).")
        optimizer = _unwrapped(self.optimizer)
        state = {"optimizer": get_optimizer_state_dict(self.model, optimizer)}
        dcp.load(state, checkpoint_id=directory)
        set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state["optimizer"])
        scheduler_file = os.path.join(checkpoint, SCHEDULER_FILE)
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))


class ShardedTrainer(ShardedTrainerMixin, Trainer):
    """``transformers.Trainer`` for a model annotated by ``fully_shard``
    (see :class:`ShardedTrainerMixin`)."""


def _check_model(trainer: str, model: Any) -> None:
    if not isinstance(model, ShardedModule):
        raise ValueError(f"{trainer} needs a model whose root is annotated by fully_shard "
                         f"(got {type(model).__name__}). {_FIX}")


def _check_precision(trainer: str, args: Any) -> None:
    if getattr(args, "bf16", False) or getattr(args, "fp16", False):
        raise ValueError(
            f"{trainer}: TrainingArguments(bf16/fp16=True) has no effect here (accelerate "
            "autocasts the model while preparing it, and the mixin hands it over prepared): the "
            "run would be fp32. Pass fully_shard(..., mp_policy=MixedPrecisionPolicy("
            "param_dtype=torch.bfloat16)) instead and leave bf16/fp16 off.")


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """accelerate's ``AcceleratedOptimizer`` holds the user's optimizer."""
    return getattr(optimizer, "optimizer", optimizer)


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)
