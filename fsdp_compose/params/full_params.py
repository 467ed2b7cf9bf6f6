"""``full_params``: every managed parameter whole, in its original shape,
inside a ``with`` block (FSDP1's ``summon_full_params``).

For code that reads or writes whole parameters between iterations::

    with torch.device("meta"):
        model = Transformer(cfg)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cuda")
    with torch.no_grad(), fsdp_compose.params.full_params(model):
        model.init_weights()            # nn.init.trunc_normal_(p), p.copy_(full_value), ...

also EMA copies (``ema[n].lerp_(p, 0.01)`` on whole values), weight surgery
(``model.head.weight[:k].copy_(...)``), and generation or evaluation under
``torch.no_grad()`` (forward reads the whole parameters as they are: no
all-gather, no mixed-precision casts, each rank may run different inputs).

[Note: full_params]
Entering all-gathers every flat buffer of the held units in the parameters'
own dtype (not the compute dtype: fp32 stays fp32) and points each original
``nn.Parameter``'s ``.data`` at its whole view, so identity, names and
``requires_grad`` are kept and whatever the block writes (through the
parameter or its ``.data``) lands in that whole copy. Leaving with
``writeback=True`` first checks, with one tiny all-gather per unit, that
every rank holds the same whole values (a rank that wrote something else
would otherwise silently keep its slice of different values); then each
rank copies its own slice into its shard. ``writeback=False`` or an
exception leaving the block restores the shards as they were, without any
collective (a rank raising alone must not leave the others waiting).
All held units are whole at once, so the whole model must fit on one rank
(at most twice over with ``offload_to_cpu`` while a buffer is moved); for
larger models initialise with :func:`fsdp_compose.materialize`, which holds
one unit at a time. Gradients (``.grad``) stay the sharded views they were.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ..comm.agreement import disagreement, fingerprint_of
from ..runtime.collective_queue import gather_values
from ..runtime.state import state_of, units_below
from ..runtime.training_state import TrainingState
from ..runtime.unit import Unit
from .whole import Assembled, keep_own_slice, point_params_at, point_params_at_shard

__all__ = ["full_params"]


class _Held(NamedTuple):
    """One unit held whole: its whole values per buffer (``None`` where this
    rank does not hold them: ``rank0_only`` on other ranks)."""

    unit: Unit
    full: list[Optional[torch.Tensor]]
    assembled: list[Assembled]
    """Per buffer, the copies :func:`point_params_at` handed out."""


@contextlib.contextmanager
def full_params(module: nn.Module, *, writeback: bool = True, recurse: bool = True,
                rank0_only: bool = False, offload_to_cpu: bool = False) -> Iterator[None]:
    """Inside the block, every parameter managed by the units of ``module``
    has its whole shape and values (see [Note: full_params]).

    Args:
        module: an annotated module, or any module with annotated modules
            below it.
        writeback: keep what the block wrote: on exit each rank keeps its
            own slice of the whole values. Every rank must hold the same
            whole values then (write the same thing on every rank); if not,
            every rank raises ``RuntimeError`` naming the parameter and the
            ranks, and nothing is written back. ``False``: the shards are
            restored as they were.
        recurse: hold every unit in ``module``'s subtree; ``False``: only
            ``module``'s own unit (``module`` must be annotated).
        rank0_only: only global rank 0 gets whole parameters (the others
            take part in the all-gathers and keep their shards); needs
            ``writeback=False``. A forward inside the block raises on the
            other ranks.
        offload_to_cpu: hold the whole values on the CPU (each buffer is
            moved right after its all-gather).

    All options are keyword-only (FSDP1's ``summon_full_params`` takes
    ``recurse`` second). Collective: enter and leave on every rank.

    Raises:
        ValueError: ``rank0_only`` with ``writeback``; ``recurse=False`` on
            a module that is not annotated.
        RuntimeError: a unit is in a forward or backward, already held by
            an enclosing ``full_params``, or still on the meta device; a
            forward inside the block with gradients enabled (its backward
            would produce whole-shape gradients); ranks that wrote
            different values (``writeback``).
    """
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
            _check_same_values(held)  # before anything is written back: all or nothing
        except BaseException:
            _release(held, hooks, writeback=False)
            raise
    _release(held, hooks, writeback=writeback)


# ----------------------------------------------------------------- helpers
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
    """Raise (on every rank: the states are the same everywhere) before any collective."""
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
            # e.g. the root after a forward: autograd saved views of its unsharded
            # storage, which holding it whole would free (reshard) under the backward
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
    """All-gather the unit's buffers and point its parameters at the whole
    values (where this rank holds them)."""
    unit.reshard()  # e.g. kept unsharded by set_reshard_after_backward(False)
    fulls: list[Optional[torch.Tensor]] = []
    assembled: list[Assembled] = []
    for buffer in unit.buffers:
        buffer.drop_post_forward_copy()  # its values may be rewritten: never reuse it
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
    """Forward pre-hooks (removed on exit) that refuse a forward the held
    unit cannot run: one recording a graph, or one on a rank without values."""
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
    """Each rank keeps its own slice of the whole values (``writeback``) or
    its shard as it was; parameters are their local shard views again."""
    for hook in hooks:
        hook.remove()
    for unit, fulls, assembled in held:
        for buffer, full, copies in zip(unit.buffers, fulls, assembled):
            if full is None:
                continue  # rank0_only, another rank: the parameters never left their shard
            if writeback:
                keep_own_slice(buffer, full, copies)
            else:
                point_params_at_shard(buffer)
        state = state_of(unit.modules[0])
        if state is not None:
            state.hold_whole(False)


def _fingerprint(full: list[Optional[torch.Tensor]]) -> int:
    """Of sums over all elements and every other one, in the values' own
    dtype: identical values give identical sums."""
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
