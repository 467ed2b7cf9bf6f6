"""``_ShardState``: routes module and autograd hooks to units, and the shared
context that the root builds for every unit below it.

The state owns no tensors. On the first forward of the outermost annotated
module (the root) it builds one :class:`ShardContext` for every unit in the
root's subtree and validates what needs the whole model. After that, each
hook asks the unit to do its part; the root also queues the end-of-backward
callback that finishes the iteration.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed._composable import contract
from torch.distributed._composable_state import _State

from ._comm import all_gather_fingerprints, fingerprint_ranks
from ._compile import run_eagerly
from ._divergence import reduce_deferred
from ._finite import check_finite_gradients
from ._flat_grad import publish_gradients
from ._registration import Snapshot, check_registration, registration_snapshot
from ._unit import ShardUnit, TrainingState


class ShardContext:
    """State shared by the root and every unit below it for one model.

    Attributes:
        root: the root's state (outermost annotated module).
        states: every state in the root's subtree, root first, then in module
            registration order.
        backward_callback_queued: whether the end-of-backward callback is
            queued for the backward running now (queued once per backward).
    """

    def __init__(self, root: "_ShardState", states: list["_ShardState"]) -> None:
        self.root: _ShardState = root
        self.states: list[_ShardState] = states
        self.backward_callback_queued: bool = False


class _ShardState(_State):
    """The per-``fully_shard``-call state attached to the annotated module(s).

    Created empty by the composable-API ``contract`` and filled by
    :meth:`bind`; all hooks registered by ``fully_shard`` are its methods.
    """

    def __init__(self) -> None:
        super().__init__()
        self.unit: Optional[ShardUnit] = None
        self.context: Optional[ShardContext] = None
        self.validated: bool = False
        """Whether ranks have been checked to agree on this unit's layout."""
        self.in_forward_method: set[int] = set()
        """ids of modules running a method given to ``register_forward_method``:
        their own ``module(...)`` calls inside it are part of that pass."""
        self.registration: Snapshot = ()
        """Parameters and children of the managed modules at annotation."""
        self.annotated_parent: Optional[_ShardState] = None
        """The state of the nearest module annotated above this one (set
        when that module is annotated): its root must initialise this one."""
        self.check_finite: bool = False
        """Read on the root: check the gradients after every last backward
        (``set_check_finite_gradients``)."""
        self.held_whole: bool = False
        """``fsdp_compose.full_params`` holds this unit's parameters whole:
        forward reads them as they are (the hooks do nothing)."""

    def bind(self, unit: ShardUnit) -> None:
        self.unit = unit
        self.registration = registration_snapshot(unit.managed_modules)
        # Hooks run eagerly under torch.compile (a graph break each): they
        # resize storages and swap module attributes, which dynamo must not trace.
        pre_forward, post_forward = run_eagerly(self._pre_forward), run_eagerly(self._post_forward)
        for module in unit.modules:
            module.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(post_forward, always_call=False)

    @property
    def is_root(self) -> bool:
        return self.context is not None and self.context.root is self

    # ------------------------------------------------------------ lazy init
    def lazy_init(self) -> None:
        """Make this state the root of every state in its subtree (once), and
        validate the model as a whole before the first collective."""
        if self.context is not None:
            return  # already initialised (as root or as a unit below a root)
        if self.annotated_parent is not None:
            # A submodule's forward or unshard() ran before its root's first
            # forward: set up the whole model from the root, so this unit is
            # one of its units (not a root of its own, with its own scheduler).
            top = self.annotated_parent
            while top.annotated_parent is not None:
                top = top.annotated_parent
            top.lazy_init()
            assert self.context is not None, \
                f"[rank {self.unit.group.rank}] the root's lazy init missed {self.unit.name}"
            return
        states = [self] + [s for s in _states_below(self.unit.modules) if s is not self]
        context = ShardContext(self, states)
        for state in states:
            state.context = context
            state.unit.is_root = state is self
            state.unit.scheduler = self.unit.scheduler
            self.unit.scheduler.adopt(state.unit.buffers)
        _name_units(self.unit.modules, states)
        _check_devices(states)
        _check_ranks_agree([s for s in states if not s.validated])
        self.unit.scheduler.divergence.bind([s.unit for s in states])

    # ---------------------------------------------------------------- hooks
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if id(module) in self.in_forward_method:
            return args, kwargs  # inside a registered forward method: already unsharded
        if self.held_whole:
            return args, kwargs  # inside full_params: the parameters are whole already
        self.lazy_init()
        self.unit.check_materialized()
        check_registration(self.registration, self.context.root.unit.modules[0])
        if self.is_root and torch._C._current_graph_task_id() == -1:
            self._reset_unfinished_iteration()  # not a recomputation in backward
        if self.is_root and self.unit.state is TrainingState.IDLE:
            self.unit.scheduler.start_iteration()  # not a recomputation inside backward
        args, kwargs = self.unit.cast_inputs(args, kwargs)
        self.unit.pre_forward(module, args, kwargs)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if id(module) in self.in_forward_method:
            return output  # the registered method's own post-forward follows
        if self.held_whole:
            return output  # inside full_params: nothing was gathered
        output = self.unit.cast_output(output)
        root_unit = self.context.root.unit
        inside_root_forward = root_unit.state is TrainingState.FORWARD and root_unit is not self.unit
        completed = self.unit.post_forward(module, output, self._pre_backward,
                                           pass_ends=not inside_root_forward)
        if completed and not inside_root_forward and not self.is_root:
            self.context.root._drop_prefetches_of_outside_call(self.unit)
        if completed and self.is_root:
            self._finish_incomplete_units()
            self._drop_unused_prefetches()
            scheduler = self.unit.scheduler
            scheduler.divergence.after_root_forward(scheduler.forward_order)
            if not torch.is_grad_enabled():
                scheduler.end_iteration()  # no backward follows (e.g. evaluation)
        return output

    def _reset_unfinished_iteration(self) -> None:
        """A forward or backward that raised leaves units mid-iteration
        (every rank alike when every rank raised); going on would mix the
        two iterations (and a lost end-of-backward callback would never
        publish gradients again), so reset as ``reset_iter_state()`` would."""
        context = self.context
        busy = [s.unit for s in context.states if s.unit.state is not TrainingState.IDLE]
        if busy or context.backward_callback_queued:
            what = (f"{busy[0].name} was still in {busy[0].state.name}" if busy else
                    "the end of the last backward never ran")
            warnings.warn(
                f"forward of the root {self.unit.name} started, but the previous iteration did not "
                f"finish ({what}): a forward or backward raised an exception. fsdp_compose reset "
                "it and dropped its gradients; call reset_iter_state() on the root module after "
                "catching such an exception to do this explicitly.", stacklevel=2)
            self.reset_iter_state()

    def reset_iter_state(self) -> None:
        """See ``ShardedModule.reset_iter_state``. Runs on the root."""
        context = self.context
        if context is not None and context.root is not self:
            raise RuntimeError(
                f"reset_iter_state() was called on {self.unit.name}, which is not the root; call "
                f"it on the root module, {context.root.unit.name}.")
        states = context.states if context is not None else [self]
        for state in states:
            state.unit.reset_iter_state()
        self.unit.scheduler.discard_iteration()
        if context is not None:
            context.backward_callback_queued = False

    def _finish_incomplete_units(self) -> None:
        """A multi-module unit some of whose modules did not run: its pass
        ends with the root's forward (the outputs of the modules that ran
        carry their pre-backward hooks already)."""
        for state in self.context.states:
            unit = state.unit
            if unit.state is TrainingState.FORWARD:
                unit.complete_forward()

    def _drop_unused_prefetches(self) -> None:
        """Prefetched by last iteration's order, but not run this time (the
        control flow changed): free them now instead of at end of backward.
        Also units prefetched again after their forward (by a unit called
        twice, e.g. c1 in c1, c0, c1) when no backward will use them (a
        ``no_grad`` forward): nothing else would free them."""
        ran = {id(u) for u in self.unit.scheduler.forward_order}
        for state in self.context.states:
            unit = state.unit
            if any(b.is_gathering for b in unit.buffers) and \
                    (id(unit) not in ran or not unit.backward_possible):
                unit.reshard()

    def _drop_prefetches_of_outside_call(self, caller: ShardUnit) -> None:
        """A unit called on its own outside the root's forward (a chunked
        loss calling ``lm_head``) may have prefetched others by explicit
        targets; those that no backward will use stay gathered with nothing
        to free them: reshard them now."""
        for state in self.context.states:
            unit = state.unit
            if unit is not caller and unit.state is TrainingState.IDLE and \
                    any(b.is_gathering for b in unit.buffers) and not unit.backward_possible:
                unit.reshard()

    def _pre_backward(self) -> None:
        context = self.context
        if not context.backward_callback_queued:
            context.backward_callback_queued = True
            Variable._execution_engine.queue_callback(context.root._finalize_backward)
        self.unit.pre_backward()

    def _finalize_backward(self) -> None:
        """Queued once per backward: publish the reduced gradients (unless
        more backwards of this step follow, ``set_is_last_backward(False)``),
        reshard what is left and reset every unit."""
        context = self.context
        context.backward_callback_queued = False
        scheduler = self.unit.scheduler
        reduce_deferred([state.unit for state in context.states], scheduler)
        if self.unit.is_last_backward:
            scheduler.finish_reduces()
            scheduler.divergence.before_publish(scheduler.divergence.groups())
            publish_gradients([b for state in context.states for b in state.unit.buffers],
                              scheduler.divergence)
        for state in context.states:
            state.unit.finalize_backward()
        if self.unit.is_last_backward:
            scheduler.end_iteration()  # everything is resharded: free the staging pool
        if self.check_finite and self.unit.is_last_backward:
            check_finite_gradients(self.unit.modules[0])  # raises out of backward, every rank


# ----------------------------------------------------------------- helpers
def link_annotated_below(state: _ShardState) -> None:
    """``state``'s module was just annotated: units annotated below it
    (earlier, bottom-up) learn that a root above them will initialise them."""
    for below in _states_below(state.unit.modules):
        if below is not state and below.annotated_parent is None:
            below.annotated_parent = state


def _register_unit(module: Any, unit: ShardUnit) -> Any:
    state = register_unit.state(module if isinstance(module, nn.Module) else module[0])
    state.bind(unit)
    return module


# torch's composable-API registry keys an API by its function's name; other
# composable APIs (e.g. replicate) look for "fully_shard" there.
_register_unit.__name__ = "fully_shard"
register_unit = contract(state_cls=_ShardState)(_register_unit)
"""Attach a new ``_ShardState`` for ``unit`` to the module(s) through the
composable-API ``contract`` (which also checks that no FQN changed)."""


def state_of(module: nn.Module) -> Optional[_ShardState]:
    """The ``_ShardState`` attached to ``module``, if it was annotated."""
    state = register_unit.state(module)
    return state if isinstance(state, _ShardState) and state.unit is not None else None


def units_below(module: nn.Module) -> list[ShardUnit]:
    """Every unit annotated in ``module``'s subtree, in module order."""
    return [state.unit for state in _states_below((module,)) if state.unit is not None]


def _states_below(modules: tuple[nn.Module, ...]) -> list[_ShardState]:
    seen: dict[int, _ShardState] = {}
    for top in modules:
        for sub in top.modules():
            state = state_of(sub)
            if state is not None and id(state) not in seen:
                seen[id(state)] = state
    return list(seen.values())


def _name_units(roots: tuple[nn.Module, ...], states: list[_ShardState]) -> None:
    names = {}
    for top in roots:
        for name, sub in top.named_modules():
            names.setdefault(sub, name)
    for state in states:
        first = state.unit.modules[0]
        label = names.get(first, "")
        state.unit.name = f"'{label}' ({type(first).__name__})" if label else \
            f"<root> ({type(first).__name__})"


def _check_devices(states: list[_ShardState]) -> None:
    root = states[0].unit
    for state in states[1:]:
        if state.unit.group.device != root.group.device:
            raise ValueError(
                f"fully_shard units of one model must compute on one device: root {root.name} "
                f"uses {root.group.device} but {state.unit.name} uses {state.unit.group.device}. "
                "Pass the same mesh (or none) to every fully_shard call.")


def _layout_fingerprint(units: list[ShardUnit]) -> int:
    text = repr([[(r.fqn, tuple(r.shape), str(r.param.dtype), r.param.requires_grad, b.is_meta)
                  for b in u.buffers for r in b.records] for u in units])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _check_ranks_agree(states: list[_ShardState]) -> None:
    """One tiny all-gather per process group: every rank raises together if
    any rank has a different set of parameter names, shapes or dtypes (a
    mismatch would otherwise hang or silently mix values in the first
    all-gather)."""
    by_group: dict[int, list[_ShardState]] = {}
    for state in states:
        by_group.setdefault(id(state.unit.group.process_group), []).append(state)
    for group_states in by_group.values():
        units = [s.unit for s in group_states]
        group = units[0].group
        prints = all_gather_fingerprints(_layout_fingerprint(units), group)
        if len(set(prints)) > 1:
            mine = _layout_fingerprint(units)
            ranks = fingerprint_ranks(group)
            differing = sorted({ranks[i] for i, p in enumerate(prints) if p != prints[0]})
            raise RuntimeError(
                f"[rank {group.rank}] ranks disagree on the parameters of the fully_shard units "
                f"{[u.name for u in units]}: ranks {differing} have different names, shapes, "
                f"dtypes or meta-ness than rank {ranks[0]} (this rank's fingerprint {mine:#x}). "
                "Build the "
                "same model on every rank before calling fully_shard (and materialise meta "
                "parameters on every rank before the first forward).")
        for state in group_states:
            state.validated = True
