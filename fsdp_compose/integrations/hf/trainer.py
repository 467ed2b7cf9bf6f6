"""Hugging Face's ``Trainer`` training a model annotated by ``fully_shard``.

Outside FSDP and DeepSpeed, accelerate wraps every multi-process model in
``DistributedDataParallel``, and the Trainer saves the model and the
optimizer from rank 0 alone. On an fsdp_compose model both are wrong: each
rank holds different rows of every parameter (DDP would all-reduce and
broadcast unrelated shards) and of the optimizer state. The mixin keeps the
Trainer's loop, logging, data loading and file layout, and changes only
what touches the shards:

* the model the trainer built (TRL's ``SFTTrainer`` loads a model path and
  applies ``peft_config`` in its constructor) is annotated after the
  trainer's constructor, unless it came annotated: each layer, then the
  root (``_annotate.py``), in the precision of ``bf16`` / ``fp16``
  (``_precision.py``);
* the optimizer's groups are the Trainer's name-based decay / no-decay
  split, so an empty one is not warned about; ``floating_point_ops`` counts
  whole parameters, not this rank's pieces;
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
from transformers.utils import logging

from ...api import param_info
from ...checks.empty_groups import groups_chosen_by_name
from ...gradients.grad_scaler import ShardedGradScaler
from ...module_methods.sharded_module import ShardedModule
from . import _annotate, _precision

logger = logging.get_logger(__name__)

OPTIMIZER_DIR = "optimizer"
"""The checkpoint's subdirectory holding the sharded optimizer state."""
SCHEDULER_FILE = "scheduler.pt"
"""The Trainer's name for the learning-rate scheduler's state."""

_OVERRIDDEN = ("_wrap_model", "save_model", "_save", "_save_optimizer_and_scheduler",
               "_load_optimizer_and_scheduler", "create_optimizer", "floating_point_ops")
"""The Trainer methods the mixin overrides or calls: checked at construction,
so a transformers release that renames one fails loudly instead of
silently saving rank 0's shards."""



class ShardedTrainerMixin:
    """Put in front of ``transformers.Trainer`` or a subclass of it
    (``class ShardedSFTTrainer(ShardedTrainerMixin, SFTTrainer)``) and build
    the trainer as usual: a model object or, for trainers that load one
    (TRL's), a model path, with ``peft_config=`` where the trainer takes it.

    The model the trainer holds after its constructor is annotated by
    ``fully_shard``: each module of ``fsdp_config["transformer_layer_cls_to_wrap"]``
    (else of the model's ``_no_split_modules``), then the root, with
    ``reshard_after_forward``, ``cpu_offload`` and ``activation_checkpointing``
    from the same ``fsdp_config``; ``bf16=True`` / ``fp16=True`` become
    ``MixedPrecisionPolicy(param_dtype=bf16 or fp16, reduce_dtype=fp32)``.
    A model that comes annotated (its root included) is used as it is, its
    units' ``mp_policy`` deciding the precision; a flag asking for another
    precision, or ``peft_config=`` (PEFT would add parameters to annotated
    modules), is refused."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        missing = [method for method in _OVERRIDDEN if not hasattr(Trainer, method)]
        if missing:
            raise RuntimeError(f"{name} overrides Trainer.{', Trainer.'.join(missing)}, "
                               "which this transformers release lacks; install the tested range "
                               "(pip install 'fsdp_compose[hf]').")
        # checked before the trainer's constructor, which applies PEFT and fixes accelerate's
        # process-wide state
        if kwargs.get("model_init") is not None:
            raise ValueError(f"{name} does not take model_init=: the Trainer calls it again inside "
                             "train() for a fresh model, which would not be annotated. Build the "
                             "model and pass model=.")
        model = kwargs.get("model", args[0] if args else None)
        given_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        annotated = _check_annotation(name, model)
        if annotated and given_args is not None:
            _precision.check_agrees(name, model, _precision.flag_dtype(given_args))
        if annotated and kwargs.get("peft_config") is not None:
            raise ValueError(
                f"{name} got a model annotated by fully_shard and peft_config=: PEFT would add its "
                "adapter parameters to modules fully_shard has already sharded. Pass the model "
                "unannotated (the trainer applies peft_config, then annotates it), or apply PEFT "
                "(peft.get_peft_model) before fully_shard and pass no peft_config.")
        super().__init__(*args, **kwargs)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            raise ValueError(f"{name} shards with fsdp_compose: turn off accelerate's "
                             "FSDP / DeepSpeed (TrainingArguments fsdp=..., deepspeed=...).")
        dtype = _precision.flag_dtype(self.args)
        if annotated:
            _precision.check_agrees(name, self.model, dtype)  # the trainer's default arguments
        else:
            policy = _precision.policy_for(dtype)
            layers = _annotate.annotate(self.model, _annotate.fsdp_config(self.args), policy)
            if self.args.should_log:
                logger.warning(f"{name}: fully_shard on each {' / '.join(layers)} and the root, "
                               f"{_precision.describe(policy)}.")
        if getattr(self.accelerator, "scaler", None) is not None:
            # fp16: skip or take a step on every rank together (each holds other gradients)
            self.accelerator.scaler = ShardedGradScaler(self.args.device.type)

    # ------------------------------------------------------------ training
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        # accelerate skips what it has prepared: no DistributedDataParallel around the shards
        model._is_accelerate_prepared = True
        return model

    def create_optimizer(self, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer; its decay / no-decay groups are chosen by
        parameter name, so one left empty (a LoRA model's no-decay group) is
        the rule's intent, not a shard's shape misleading it. An optimizer
        passed in (``optimizers=``) keeps the check."""
        builds = self.optimizer is None
        optimizer = super().create_optimizer(model)  # type: ignore[misc]
        if builds:
            groups_chosen_by_name(_unwrapped(optimizer))
        return optimizer

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """The Trainer's count (6 x tokens x non-embedding parameters), with
        each parameter's whole size: ``p.numel()`` is this rank's piece."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return 0
        return 6 * inputs[main_input].numel() * _whole_parameters(self.model, exclude_embeddings=True)

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


def _check_annotation(trainer: str, model: Any) -> bool:
    """Whether ``model`` comes annotated; raises ``ValueError`` for one whose
    layers are annotated but not its root."""
    if not isinstance(model, nn.Module) or isinstance(model, ShardedModule):
        return isinstance(model, ShardedModule)
    below = [n for n, m in model.named_modules() if isinstance(m, ShardedModule)]
    if below:
        raise ValueError(
            f"{trainer}: {len(below)} module(s) of the model are annotated by fully_shard "
            f"('{below[0]}'...) but not its root {type(model).__name__}: call fully_shard(model) "
            "last, or pass the model unannotated and let the trainer annotate it.")
    return False


def _whole_parameters(model: nn.Module, exclude_embeddings: bool) -> int:
    """Elements of the model's parameters at their original sizes (each
    shared parameter once)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    total = 0
    for p in model.parameters():
        if exclude_embeddings and id(p) in embeddings:
            continue
        info = param_info(p)
        total += info.numel if info is not None else p.numel()
    return total


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """accelerate's ``AcceleratedOptimizer`` holds the user's optimizer."""
    return getattr(optimizer, "optimizer", optimizer)


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)
