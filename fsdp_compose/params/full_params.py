"""``full_params``: every managed parameter whole, in its original shape,
inside a ``with`` block (FSDP1's ``summon_full_params``).

[Note: full_params]
Entering all-gathers the held units in the parameters' own dtype and points
each ``.data`` at its whole view. Leaving with ``writeback=True`` first
checks, with one small all-gather per unit, that every rank holds the same
values, then each rank copies its slice into its shard. ``writeback=False``
or an exception restores the shards without any collective (a rank raising
alone must not leave the others waiting).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ..comm.agreement import disagreement, fingerprint_of
from ..runtime.state import state_of, units_below
from ..runtime.training_state import TrainingState
from ..runtime.unit import Unit
from .whole import (Assembled, gather_values, keep_own_slice, point_params_at,
                    point_params_at_shard)

__all__ = ["full_params"]


class _Held(NamedTuple):
    """One unit held whole (values ``None`` on ranks ``rank0_only`` leaves out)."""

    unit: Unit
    full: list[Optional[torch.Tensor]]
    assembled: list[Assembled]


@contextlib.contextmanager
def full_params(module: nn.Module, *, writeback: bool = True, recurse: bool = True,
                rank0_only: bool = False, offload_to_cpu: bool = False) -> Iterator[None]:
    """Inside the block, every parameter managed by the units of ``module`` has
    its whole shape and values ([Note: full_params]). Collective: enter and
    leave on every rank.

    Args:
        module: an annotated module, or one with annotated modules below.
        writeback: on exit each rank keeps its slice of the whole values,
            which must be equal on every rank. ``False``: shards restored.
        recurse: every unit in the subtree; ``False``: ``module``'s own only.
        rank0_only: only global rank 0 gets whole parameters (needs
            ``writeback=False``; a forward on other ranks raises).
        offload_to_cpu: hold the whole values on the CPU.

    Raises:
        ValueError: ``rank0_only`` with ``writeback``; ``recurse=False`` on an
            unannotated module.
        RuntimeError: a unit in a forward or backward, already held, or on
            meta; a forward with gradients inside the block; ranks that wrote
            different values."""
    if rank0_only and writeback:
        raise ValueError("full_params(rank0_only=True, writeback=True): only rank 0 would hold "
                         "the values to write back; pass writeback=False (as FSDP1 requires).")
    units = _units(module, recurse)
    _check_can_hold(units)
    holds_values = not rank0_only or dist.get_rank() == 0
    held: list[_Held] = []
    hooks: list[RemovableHandle] = []
    try:
        for unit in units:
            held.append(_hold(unit, holds_values, offload_to_cpu))
            hooks += _forward_guards(unit, holds_values)
    except BaseException:
        _release(held, hooks, writeback=False)
        raise
    try:
        yield
    except BaseException:
        _release(held, hooks, writeback=False)  # no collective: others may not have raised
        raise
    if writeback:
        try:
            _check_same_values(held)  # all or nothing
        except BaseException:
            _release(held, hooks, writeback=False)
            raise
    _release(held, hooks, writeback=writeback)


def _units(module: nn.Module, recurse: bool) -> list[Unit]:
    if recurse:
        return units_below(module)
    state = state_of(module)
    if state is None:
        raise ValueError(
            f"full_params({type(module).__name__}, recurse=False): the module is not annotated "
            "by fully_shard, so it has no unit of its own; pass an annotated module or "
            "recurse=True.")
    return [state.unit]


def _first_fqn(unit: Unit) -> str:
    return unit.buffers[0].records[0].fqn if unit.buffers else unit.name


def _check_can_hold(units: list[Unit]) -> None:
    """Raise on every rank before any collective."""
    for unit in units:
        state = state_of(unit.modules[0])
        if state is not None and state.held_whole:
            raise RuntimeError(
                f"full_params: {unit.name} (parameter '{_first_fqn(unit)}') is already held whole "
                "by an enclosing full_params block; nest no second block over the same units.")
        if unit.training_state is not TrainingState.IDLE or any(
                b.is_gathering or b.grad.is_reducing for b in unit.buffers):
            raise RuntimeError(
                f"full_params: {unit.name} (parameter '{_first_fqn(unit)}') is in its "
                f"{unit.training_state.name.lower()} or has collectives in flight; use full_params "
                "between iterations (after backward and the optimizer step), not inside a "
                "forward or backward.")
        if unit.is_unsharded and unit.backward_possible:
            # e.g. the root after a forward: autograd saved views of its unsharded storage
            raise RuntimeError(
                f"full_params: {unit.name} (parameter '{_first_fqn(unit)}') is unsharded after "
                "a forward that recorded a graph, whose backward may still read it. Run the "
                "backward first; if the unit is only kept unsharded on purpose "
                "(set_reshard_after_backward(False), unshard()), call "
                "model.reshard(recurse=True) before full_params.")
        meta = [b for b in unit.buffers if b.is_meta]
        if meta:
            raise RuntimeError(
                f"full_params: parameter '{meta[0].records[0].fqn}' of {unit.name} is still on "
                "the meta device; call model.to_empty(device=...) first (then initialise "
                "inside full_params), or fsdp_compose.materialize(model).")


def _hold(unit: Unit, holds_values: bool, offload_to_cpu: bool) -> _Held:
    unit.reshard()  # e.g. kept unsharded by set_reshard_after_backward(False)
    fulls: list[Optional[torch.Tensor]] = []
    assembled: list[Assembled] = []
    for buffer in unit.buffers:
        buffer.drop_post_forward_copy()  # its values may be rewritten
        full = gather_values(buffer)
        if offload_to_cpu:
            full = full.cpu()
        if holds_values:
            assembled.append(point_params_at(buffer, full))
            fulls.append(full)
        else:
            assembled.append({})
            fulls.append(None)
    state = state_of(unit.modules[0])
    if state is not None:
        state.hold_whole(True)
    return _Held(unit, fulls, assembled)


def _forward_guards(unit: Unit, holds_values: bool) -> list[RemovableHandle]:
    """Forward pre-hooks refusing a forward that records a graph or runs
    on a rank without values."""
    params = [r.param for b in unit.buffers for r in b.records]

    def guard(module: nn.Module, args: tuple) -> None:
        if not holds_values:
            raise RuntimeError(
                f"forward of {unit.name} inside full_params(rank0_only=True) on rank "
                f"{dist.get_rank()}: only rank 0 holds the whole parameters. Run the forward on "
                "rank 0 only, or use rank0_only=False.")
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            raise RuntimeError(
                f"forward of {unit.name} (parameter '{_first_fqn(unit)}') inside full_params with "
                "gradients enabled: its backward would give whole-shape gradients to sharded "
                "parameters. Wrap it in torch.no_grad() (generation, evaluation), or train "
                "outside full_params.")

    return [m.register_forward_pre_hook(guard, prepend=True) for m in unit.modules]


def _release(held: list[_Held], hooks: list[RemovableHandle], writeback: bool) -> None:
    """Each rank keeps its slice of the whole values (``writeback``) or its
    shard as it was."""
    for hook in hooks:
        hook.remove()
    for unit, fulls, assembled in held:
        for buffer, full, copies in zip(unit.buffers, fulls, assembled):
            if full is None:
                continue  # rank0_only: never left their shard
            if writeback:
                keep_own_slice(buffer, full, copies)
            else:
                point_params_at_shard(buffer)
        state = state_of(unit.modules[0])
        if state is not None:
            state.hold_whole(False)


def _fingerprint(full: list[Optional[torch.Tensor]]) -> int:
    return fingerprint_of(repr([(float(t.sum()), float(t[::2].sum()))
                                for t in full if t is not None]))


def _check_same_values(held: list[_Held]) -> None:
    for unit, full, _ in held:
        if not unit.buffers:
            continue
        differ = next((found for group, indices in unit.buffers_by_group()
                       if (found := disagreement(_fingerprint([full[i] for i in indices]), group))
                       is not None), None)
        if differ is not None:
            raise RuntimeError(
                f"full_params(writeback=True): ranks {differ.differing} hold different values "
                f"than rank {differ.reference} for {unit.name} (parameters from "
                f"'{_first_fqn(unit)}') at the end of the block, so each rank's kept slice would "
                "come from a different model; nothing was written back. Write the same values "
                "on every rank (seed every rank the same before random initialisation), or use "
                "writeback=False.")
