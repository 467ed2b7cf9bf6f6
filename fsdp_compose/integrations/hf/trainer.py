"""Hugging Face's ``Trainer`` training a model annotated by ``fully_shard``.

accelerate wraps the model in DDP and the Trainer saves from rank 0 alone,
both wrong when ranks hold different shards. The mixin keeps the Trainer's
loop and files and changes what touches the shards: no DDP wrapper,
accumulation through ``no_sync``, whole-parameter ``floating_point_ops``,
gathered ``save_model``, and the optimizer state as a DCP directory
``optimizer/``.
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
SCHEDULER_FILE = "scheduler.pt"

_OVERRIDDEN = ("_wrap_model", "save_model", "_save", "_save_optimizer_and_scheduler",
               "_load_optimizer_and_scheduler", "create_optimizer", "floating_point_ops")
"""Trainer methods the mixin overrides or calls, checked at construction so
a renaming release fails loudly."""



class ShardedTrainerMixin:
    """Put in front of ``transformers.Trainer`` or a subclass
    (``class ShardedSFTTrainer(ShardedTrainerMixin, SFTTrainer)``) and build
    the trainer as usual.

    After the constructor the model is annotated: each module of
    ``fsdp_config["transformer_layer_cls_to_wrap"]`` (else
    ``_no_split_modules``), then the root, with ``reshard_after_forward``,
    ``cpu_offload`` and ``activation_checkpointing`` from ``fsdp_config``;
    ``bf16``/``fp16`` become ``MixedPrecisionPolicy(param_dtype=...,
    reduce_dtype=fp32)``. A model that comes annotated is used as it is; a
    flag asking for another precision, or ``peft_config=``, is then refused."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        missing = [method for method in _OVERRIDDEN if not hasattr(Trainer, method)]
        if missing:
            raise RuntimeError(f"{name} overrides Trainer.{', Trainer.'.join(missing)}, "
                               "which this transformers release lacks; install the tested range "
                               "(pip install 'fsdp_compose[hf]').")
        # checked before the constructor, which applies PEFT and sets accelerate's state
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
            _precision.check_agrees(name, self.model, dtype)
        else:
            policy = _precision.policy_for(dtype)
            layers = _annotate.annotate(self.model, _annotate.fsdp_config(self.args), policy)
            if self.args.should_log:
                logger.warning(f"{name}: fully_shard on each {' / '.join(layers)} and the root, "
                               f"{_precision.describe(policy)}.")
        if getattr(self.accelerator, "scaler", None) is not None:
            self.accelerator.scaler = ShardedGradScaler(self.args.device.type)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        # accelerate skips what it has prepared: no DDP around the shards
        model._is_accelerate_prepared = True
        return model

    def create_optimizer(self, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer (an empty group is intended, not warned about)."""
        builds = self.optimizer is None
        optimizer = super().create_optimizer(model)  # type: ignore[misc]
        if builds:
            groups_chosen_by_name(_unwrapped(optimizer))
        return optimizer

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """The Trainer's count with whole parameter sizes."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return 0
        return 6 * inputs[main_input].numel() * _whole_parameters(self.model, exclude_embeddings=True)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Every rank gathers; rank 0 writes ``save_pretrained``'s files."""
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
    """Whether ``model`` comes annotated; ``ValueError`` if its layers are but
    not its root."""
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
    """Elements of the parameters at original sizes, shared ones once."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    total = 0
    for p in model.parameters():
        if exclude_embeddings and id(p) in embeddings:
            continue
        info = param_info(p)
        total += info.numel if info is not None else p.numel()
    return total


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)
