"""Setting up a tied parameter across units at annotation ([Note: tied
parameters across units]): borrowed where both units shard over the same
groups and it is not tensor-parallel, refused with the fix otherwise.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch.nn as nn

from .._naming import join_fqn, module_qualified_names, outermost_ancestors
from ..comm.groups import ShardGroup
from ..runtime.owners import Owner, owner_of, replacement_of
from ..runtime.state import state_of
from ..runtime.tied import borrow
from ..runtime.unit import Unit


class Tie(NamedTuple):
    """A parameter of another unit the new unit borrows."""

    owner: Owner
    module: nn.Module
    attr: str
    fqn: str  # both names in the model that holds the two modules
    owner_fqn: str


def check_not_owned(param: nn.Parameter, fqn: str, module: nn.Module,
                    names: dict[int, str], *, group: ShardGroup,
                    tied: list[Tie]) -> Optional[bool]:
    """Raise if ``param`` belongs to an earlier unit that cannot lend it; where
    it can, add it to ``tied`` and return ``False``."""
    replacement = replacement_of(param)  # a tensor-parallel parameter another unit took
    owner = owner_of(param if replacement is None else replacement)
    if owner is None:
        return None
    fqn, other = _both_names(fqn, owner, module, names)
    if any(module is m for m in owner.unit.managed_modules):
        record = owner.buffer.records[owner.index]
        raise ValueError(
            f"parameter '{record.fqn}' (here '{fqn}') is already managed by an earlier "
            f"fully_shard call on an ancestor, {owner.unit.name}. Annotate bottom-up: call "
            "fully_shard on children before their parents.")
    reason = _cannot_lend(owner, group)
    if reason is not None:
        raise ValueError(
            f"parameter '{fqn}' is the same tensor as '{other}', which another fully_shard unit "
            f"({owner.unit.name}) already manages (e.g. a tied input embedding and output head), "
            f"and it cannot be shared across these units: {reason}. Annotate the common ancestor "
            "of both modules instead of the module that holds it, or pass it in ignored_params.")
    tied.append(Tie(owner, module, fqn.rpartition(".")[2], fqn, other))
    return False


def _cannot_lend(owner: Owner, group: ShardGroup) -> Optional[str]:
    """Why ``owner``'s parameter cannot be borrowed over ``group`` (``None``: it
    can)."""
    if owner.buffer.group.process_group is not group.process_group or \
            owner.buffer.group.replicate_process_group is not group.replicate_process_group:
        return (f"the two units are sharded over different meshes ({owner.unit.name} over "
                f"{owner.buffer.group.mesh}, the new one over {group.mesh})")
    if owner.buffer.records[owner.index].tp is not None:
        return "it is tensor-parallel (a DTensor)"
    return None


def _both_names(fqn: str, owner: Owner, module: nn.Module,
                names: dict[int, str]) -> tuple[str, str]:
    """The parameter's name here and the owner's, in the model holding both
    modules where one does."""
    record = owner.buffer.records[owner.index]
    owner_module, owner_attr = record.slots[0]
    other = join_fqn(names[id(owner_module)], owner_attr) if id(owner_module) in names \
        else record.fqn
    in_model = module_qualified_names(outermost_ancestors([module, owner_module]))
    if id(module) in in_model and id(owner_module) in in_model:
        fqn = join_fqn(in_model[id(module)], fqn.rpartition(".")[2])
        other = join_fqn(in_model[id(owner_module)], owner_attr)
    return fqn, other


def borrow_from_owner(unit: Unit, tie: Tie) -> None:
    """``unit`` borrows ``tie``'s parameter from its owner."""
    owner = tie.owner

    def is_held_whole() -> bool:
        state = state_of(owner.unit.modules[0])
        return state is not None and state.held_whole

    def lazy_init() -> None:
        state_of(unit.modules[0]).lazy_init()
    borrow(owner.unit, unit, owner.buffer, owner.index, tie.module, tie.attr, tie.fqn,
           tie.owner_fqn, is_held_whole, lazy_init)
