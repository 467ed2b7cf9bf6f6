"""The zero-copy checkpoint path: each rank writes its flat shard's pieces as DCP boxes and reads
them straight back::

    model_sd, optim_sd = flat_state_dict(model, optim)            # no copy, no exchange
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=d,
             planner=FlatSavePlanner())
    # resume: build, annotate, then (values land in the shards during dcp.load)
    model_sd, optim_sd = flat_state_dict(model, optim)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=d,
             planner=FlatLoadPlanner())
    set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)

The files are ordinary DCP checkpoints, loadable by FSDP2, unsharded models
and any world size or placement, and this path loads theirs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional, Union

import torch
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner, DefaultSavePlanner,
                                                           create_default_local_save_plan)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.optim import Optimizer

from .._torch_private import flatten_state_dict
from ._pieces import ShardPieces, flat_values


def flat_state_dict(model: nn.Module, optimizers: Union[Optimizer, Iterable[Optimizer], None] = None,
                    *, options: Optional[StateDictOptions] = None
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``get_state_dict(model, optimizers)`` whose managed values share the
    flat shards' memory. Collective; units between iterations. Save with
    ``planner=FlatSavePlanner()``, load with ``planner=FlatLoadPlanner()``;
    ``full_state_dict`` and ``cpu_offload`` are refused."""
    if options is not None and (options.full_state_dict or options.cpu_offload):
        raise ValueError("flat_state_dict writes each rank's shards as they lie; for "
                         "full_state_dict / cpu_offload use torch's get_state_dict")
    with flat_values():
        return get_state_dict(model, optimizers if optimizers is not None else [],
                              options=options)


class FlatSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that also writes :class:`ShardPieces` in place (no plan
    caching)."""

    def create_local_plan(self) -> SavePlan:
        ours = {fqn: v for fqn, v in self.state_dict.items() if isinstance(v, ShardPieces)}
        rest = {fqn: v for fqn, v in self.state_dict.items() if fqn not in ours}
        plan = create_default_local_save_plan(rest, self.is_coordinator)
        plan = dataclasses.replace(plan, items=plan.items + [
            item for fqn, value in ours.items() for item in value.write_items(fqn)])
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, ShardPieces):
            return value.view_at(tuple(index.offset))
        return super().lookup_object(index)


class FlatLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that also reads into :class:`ShardPieces`.
    ``ValueError`` on every rank for an optimizer state dict without state
    whose parameters' state the checkpoint holds (it would stay fresh)."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Optional[Metadata] = None,
                       is_coordinator: bool = False) -> None:
        if metadata is not None:
            _refuse_stateless_optimizers(state_dict, metadata)
        # DCP's set-up replaces unknown values by None: keep ours aside
        ours = _take_pieces(state_dict)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for container, key, value in ours:
            container[key] = value
        if ours and self.flatten_state_dict:
            self.state_dict, self.mappings = flatten_state_dict(self.original_state_dict)
        elif ours:
            self.state_dict = self.original_state_dict

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, ShardPieces):
            return value.view_at(tuple(index.offset))
        return super().lookup_tensor(index)


def _take_pieces(tree: Any) -> list[tuple[Any, Any, ShardPieces]]:
    found = []
    items = tree.items() if isinstance(tree, dict) else \
        enumerate(tree) if isinstance(tree, list) else ()
    for key, value in list(items):
        if isinstance(value, ShardPieces):
            found.append((tree, key, value))
            tree[key] = None
        else:
            found += _take_pieces(value)
    return found


STATELESS_OPTIMIZER_FIX = (
    "Give it state to load into: call fsdp_compose.checkpoint.register_optimizer(optim) before "
    "optim.state_dict() (AdamW, Adam, SGD over annotated parameters: a fresh optimizer's state "
    "dict then holds the state its first step starts from), or take the state dict with "
    "torch's get_state_dict(model, optim) and apply it with set_state_dict (they give a fresh "
    "optimizer its state).")


def _refuse_stateless_optimizers(state_dict: dict[str, Any], metadata: Metadata) -> None:
    saved = metadata.state_dict_metadata
    for path, optim_sd in _optimizer_state_dicts(state_dict, ""):
        if optim_sd["state"]:
            continue
        ids = [i for group in optim_sd["param_groups"] if isinstance(group, dict)
               for i in group.get("params", ())]
        missing = ids
        prefixes = {i: f"{path}state.{i}." for i in missing}
        held = [i for i in missing if any(key.startswith(prefixes[i]) for key in saved)]
        if held:
            example = next(key for key in saved if key.startswith(prefixes[held[0]]))
            where = "".join(f"[{part!r}]" for part in path.rstrip(".").split(".") if part)
            raise ValueError(
                f"the optimizer state dict at state{where} has no state for {len(held)} of its "
                f"{len(ids)} parameters whose state the checkpoint holds (e.g. '{example}'): "
                "it comes from an optimizer that never stepped (optimizer.state_dict() holds "
                "state only after the first step), so loading would leave the optimizer "
                f"fresh, silently. {STATELESS_OPTIMIZER_FIX}")


def _optimizer_state_dicts(tree: Any, path: str) -> Iterable[tuple[str, dict[str, Any]]]:
    if not isinstance(tree, dict):
        return
    if isinstance(tree.get("state"), dict) and isinstance(tree.get("param_groups"), list):
        yield path, tree
        return
    for key, value in tree.items():
        yield from _optimizer_state_dicts(value, f"{path}{key}.")
