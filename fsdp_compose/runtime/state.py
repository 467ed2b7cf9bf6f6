"""``FullyShardState`` routes hooks to units and owns no tensors; the root
builds the :class:`ModelContext`.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from .._torch_private import (
    ComposableState as _State, contract, current_graph_task_id, profiler_active,
    queue_autograd_callback)
from ..buffers.flat_buffer import FlatBuffer
from ..buffers.flat_grad import FlatGradient
from ..comm.agreement import disagreement, fingerprint_of
from .tracing import NO_RANGE, call_profiled, profiled, run_eagerly
from .._naming import user_class_name
from .end_of_backward import finish_backward
from .protocols import CollectiveObserver
from .collective_queue import CollectiveQueue
from .model_settings import ModelSettings, merge_changes
from .prefetch_order import PrefetchOrder
from .training_state import TrainingState
from .unit import Unit
from .unit_paths import CollectivePath, choose_path

ROOT_LABEL = "<root>"  # FQN ""


class ModelContext:
    """State shared by the units of one model; ``states``: root first, then
    module order (the same on every rank)."""

    __slots__ = ('backward_callback_queued', 'buffers', 'finalization_pending', 'pending_reduction',
                 'collectives', 'gradients', 'path', 'prefetch_order', 'root', 'settings',
                 'states', 'views_for_backward',
                 '__dict__', '__weakref__')

    def __init__(self, root: "FullyShardState", states: list["FullyShardState"],
                 settings: ModelSettings, prefetch_order: PrefetchOrder[Unit],
                 collectives: CollectiveQueue) -> None:
        self.root: FullyShardState = root
        self.states: list[FullyShardState] = states
        self.settings: ModelSettings = settings
        self.prefetch_order: PrefetchOrder[Unit] = prefetch_order
        self.collectives: CollectiveQueue = collectives
        self.backward_callback_queued: bool = False
        self.pending_reduction: Optional[object] = None
        """An unwaited ``finalize_backward(async_op=True)`` handle."""
        self.finalization_pending: bool = False
        """[Note: manual finalization]."""
        self.views_for_backward: list[Unit] = []
        """See :meth:`FullyShardState.reshard`."""
        self.buffers: tuple[FlatBuffer, ...] = tuple(
            buffer for state in states for buffer in state.unit.buffers)
        self.gradients: tuple[FlatGradient, ...] = tuple(buffer.grad for buffer in self.buffers)
        self.path: CollectivePath = CollectivePath(collectives)
        self.choose_path()

    def choose_path(self) -> None:
        """At lazy init and on layout changes."""
        self.path = choose_path(self.collectives, self.buffers)
        for state in self.states:
            state.unit.path = self.path


class FullyShardState(_State):
    """The state of one ``fully_shard`` call: its hooks are its methods."""

    __slots__ = ('annotated_parent', 'context', 'pending_settings', 'unit', 'validated',
                 '_held_whole', '_in_forward_method', '_new_observer',
                 '_pre_backward_hook', '_pre_forward_check')

    def __init__(self) -> None:
        super().__init__()
        self.unit: Optional[Unit] = None
        self.context: Optional[ModelContext] = None
        self.validated: bool = False
        """The ranks agree on its layout."""
        self._in_forward_method: set[int] = set()
        """ids of modules inside a registered forward method."""
        self.annotated_parent: Optional[FullyShardState] = None
        """The nearest annotated module's state above."""
        self._pre_forward_check: Callable[[nn.Module], None] = lambda root_module: None
        """See :meth:`bind`."""
        self._new_observer: Callable[[], CollectiveObserver] = CollectiveObserver
        self.pending_settings: dict[str, object] = {}
        """Model-wide changes made before lazy init."""
        self._held_whole: bool = False

    def bind(self, unit: Unit, pre_forward_check: Optional[Callable[[nn.Module], None]] = None,
             new_observer: Callable[[], CollectiveObserver] = CollectiveObserver) -> None:
        """Attach ``unit`` and install its forward hooks (once)."""
        self.unit = unit
        unit.backward_started = self._queue_end_of_backward
        me = weakref.ref(self)

        def layout_changed() -> None:
            state = me()
            if state is not None and state.context is not None:
                state.context.choose_path()
        unit.layout_changed = layout_changed

        def pre_backward_hook(_grads: Any) -> None:
            state = me()
            if state is not None:
                state._pre_backward()
        self._pre_backward_hook: Callable[[Any], None] = pre_backward_hook
        """Weak: autograd keeps hooks in C++, where cycles are uncollectable."""
        if pre_forward_check is not None:
            self._pre_forward_check = pre_forward_check
        self._new_observer = new_observer
        # Eager under torch.compile: dynamo must not trace storage resizes.
        pre_forward, post_forward = run_eagerly(self._pre_forward), run_eagerly(self._post_forward)
        for module in unit.modules:
            module.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(post_forward, always_call=False)

    @property
    def is_root(self) -> bool:
        return self.context is not None and self.context.root is self

    @property
    def held_whole(self) -> bool:
        """Inside ``full_params``: the hooks do nothing."""
        return self._held_whole

    def hold_whole(self, held: bool) -> None:
        self._held_whole = held

    # ------------------------------------------------------------ lazy init
    def lazy_init(self) -> None:
        """Once: become the root, validate before the first collective."""
        if self.context is not None:
            return
        if self.annotated_parent is not None:
            # a submodule ran before its root
            top = self.annotated_parent
            while top.annotated_parent is not None:
                top = top.annotated_parent
            top.lazy_init()
            assert self.context is not None, \
                f"[rank {self.unit.group.rank}] the root's lazy init missed {self.unit.name}"
            return
        with profiled("lazy_init"):
            self._become_root()

    def _become_root(self) -> None:
        states = [self] + [s for s in states_below(self.unit.modules) if s is not self]
        _name_units(self.unit.modules, states)
        settings = ModelSettings()
        settings.change_all(merge_changes(  # may raise: before anything is shared
            [(s.unit.name, s.pending_settings) for s in states], self.unit.name))
        observer = self._new_observer()
        context = ModelContext(self, states, settings, PrefetchOrder(settings),
                               CollectiveQueue(settings, observer))
        for state in states:
            state.context = context
            state.unit.is_root = state is self
            state.unit.prefetch_order = context.prefetch_order
            state.unit.collectives = context.collectives
            context.collectives.share_staging_pool(state.unit.buffers)
            state.pending_settings = {}
        _check_devices(states)
        _check_ties_inside(states)
        _check_ranks_agree([s for s in states if not s.validated])
        observer.bind([s.unit for s in states], settings)

    def change_model_setting(self, name: str, value: object) -> None:
        """``ModelSettings.change``, now or at lazy init."""
        if self.context is not None:
            self.context.settings.change(name, value)
            self.context.prefetch_order.backward_plan = None  # the prefetch policy may change
        else:
            self.pending_settings[name] = value

    def change_unit_setting(self, name: str, value: object) -> None:
        """``UnitSettings.change``; drops the backward prefetch plan."""
        self.unit.settings.change(name, value)
        if self.unit.prefetch_order is not None:
            self.unit.prefetch_order.backward_plan = None

    def run_forward_method(self, module: nn.Module, call: Callable[..., Any],
                           args: tuple, kwargs: dict) -> Any:
        """``module_methods/forward_methods.py``."""
        running = self._in_forward_method
        if id(module) in running:
            return call(*args, **kwargs)
        hooked = self._pre_forward(module, args, kwargs)
        if hooked is not None:  # cast inputs
            args, kwargs = hooked
        running.add(id(module))
        try:
            output = call(*args, **kwargs)
        finally:
            running.discard(id(module))
        return self._post_forward(module, args, output)

    # ---------------------------------------------------------------- hooks
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if id(module) in self._in_forward_method:
            return args, kwargs  # inside a registered forward method: already unsharded
        if self._held_whole:
            return args, kwargs  # inside full_params: the parameters are whole already
        if profiler_active():
            return call_profiled("pre_forward", self.unit.name, self._unshard_for_forward,
                                 module, args, kwargs)
        return self._unshard_for_forward(module, args, kwargs)

    def _unshard_for_forward(self, module: nn.Module, args: tuple,
                             kwargs: dict) -> tuple[tuple, dict]:
        if self.context is None:
            self.lazy_init()
        unit, context = self.unit, self.context
        unit.check_materialized()
        self._pre_forward_check(context.root.unit.modules[0])
        if context.root is self:
            if current_graph_task_id() == -1:
                self._reset_unfinished_iteration()  # not a recomputation in backward
            if unit.training_state is TrainingState.IDLE:
                context.prefetch_order.start_iteration()  # not a recomputation inside backward
                context.collectives.start_iteration()
                for gradient in context.gradients:  # see [Note: the kept sharded gradient]
                    gradient.release_if_free()
        if unit.casts_inputs:
            args, kwargs = unit.cast_inputs(args, kwargs)
        unit.pre_forward(module, args, kwargs)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if id(module) in self._in_forward_method:
            return output  # the registered method's own post-forward follows
        if self._held_whole:
            return output  # inside full_params: nothing was gathered
        if profiler_active():
            return call_profiled("post_forward", self.unit.name, self._finish_forward, module,
                                 output)
        return self._finish_forward(module, output)

    def _finish_forward(self, module: nn.Module, output: Any) -> Any:
        unit, root = self.unit, self.context.root
        if unit.casts_output:
            output = unit.cast_output(output)
        root_unit = root.unit
        inside_root_forward = root_unit.training_state is TrainingState.FORWARD and root_unit is not unit
        completed = unit.post_forward(module, output, self._pre_backward_hook,
                                      pass_ends=not inside_root_forward)
        if completed and not inside_root_forward and root is not self:
            root._drop_prefetches_of_outside_call(unit)
        if completed and root is self:
            self._finish_incomplete_units()
            self._drop_unused_prefetches()
            collectives = self.context.collectives
            order = self.context.prefetch_order
            collectives.observer.after_root_forward(order.forward_order)
            if not torch.is_grad_enabled():
                collectives.end_iteration()  # no backward follows (e.g. evaluation)
            else:
                unit.path.plan_backward(order)
                collectives.end_forward()
        return output

    def _reset_unfinished_iteration(self) -> None:
        """An iteration raised: reset, with a warning."""
        context = self.context
        busy = [s.unit for s in context.states if s.unit.training_state is not TrainingState.IDLE]
        if busy or context.backward_callback_queued:
            what = (f"{busy[0].name} was still in {busy[0].training_state.name}" if busy else
                    "the end of the last backward never ran")
            warnings.warn(
                f"forward of the root {self.unit.name} started, but the previous iteration did not "
                f"finish ({what}): a forward or backward raised an exception. fsdp_compose reset "
                "it and dropped its gradients; call reset_iter_state() on the root module after "
                "catching such an exception to do this explicitly.", stacklevel=2)
            self.reset_iter_state()

    def reset_iter_state(self) -> None:
        """``ShardedModule.reset_iter_state``, on the root."""
        context = self.context
        if context is not None and context.root is not self:
            raise RuntimeError(
                f"reset_iter_state() was called on {self.unit.name}, which is not the root; call "
                f"it on the root module, {context.root.unit.name}.")
        states = context.states if context is not None else [self]
        for state in states:
            state.unit.reset_iter_state()
        if context is not None:  # else: never ran, nothing was scheduled
            context.prefetch_order.discard_iteration()
            context.collectives.discard_iteration()
            context.backward_callback_queued = False
            context.finalization_pending = False
            context.pending_reduction = None
            context.views_for_backward.clear()

    def _finish_incomplete_units(self) -> None:
        """A multi-module unit's pass ends here."""
        for state in self.context.states:
            unit = state.unit
            if unit.training_state is TrainingState.FORWARD:
                unit.complete_forward()

    def _drop_unused_prefetches(self) -> None:
        """Reshard units prefetched but not used."""
        ran = self.context.prefetch_order.ran
        for state in self.context.states:
            unit = state.unit
            if any(buffer.is_gathering for buffer in unit.buffers) and \
                    (id(unit) not in ran or not unit.backward_possible):
                unit.reshard()

    def _drop_prefetches_of_outside_call(self, caller: Unit) -> None:
        """Outside the root's forward: reshard unused explicit prefetches."""
        for state in self.context.states:
            unit = state.unit
            if unit is not caller and unit.training_state is TrainingState.IDLE and \
                    any(b.is_gathering for b in unit.buffers) and not unit.backward_possible:
                unit.reshard()

    def _pre_backward(self) -> None:
        if profiler_active():
            call_profiled("pre_backward", self.unit.name, self._unshard_for_backward)
        else:
            self._unshard_for_backward()

    def _unshard_for_backward(self) -> None:
        self._queue_end_of_backward()
        self.unit.pre_backward()

    def _queue_end_of_backward(self) -> None:
        """Once per backward."""
        context = self.context
        if not context.backward_callback_queued:
            context.backward_callback_queued = True
            queue_autograd_callback(context.root._finish_backward)
            if context.views_for_backward:
                for unit in context.views_for_backward:
                    unit.unshard()
                context.views_for_backward.clear()

    def reshard(self) -> None:
        """``ShardedModule.reshard``. Without a pre-backward hook ([Note: the
        local path]), the next backward's first event puts the views back."""
        unit = self.unit
        unit.reshard()
        if self.context is not None and unit.backward_pending_without_hook():
            self.context.views_for_backward.append(unit)

    def _finish_backward(self) -> None:
        """Queued once per backward (``end_of_backward.py``)."""
        context = self.context
        context.backward_callback_queued = False
        settings = context.settings
        last = settings.is_last_backward and not settings.manual_finalization
        context.finalization_pending = settings.manual_finalization
        order = context.prefetch_order
        with profiled("end_of_backward") if profiler_active() else NO_RANGE:
            finish_backward([state.unit for state in context.states], context.collectives,
                            order.forward_order or order.previous_forward_order, last)
        if last and settings.after_last_backward is not None:
            settings.after_last_backward(self.unit.modules[0])  # may raise, on every rank alike


# ----------------------------------------------------------------- helpers
def link_annotated_below(state: FullyShardState) -> None:
    """The states below learn their parent."""
    for below in states_below(state.unit.modules):
        if below is not state and below.annotated_parent is None:
            below.annotated_parent = state


def _attach_state(module: Any, unit: Unit, **bind_options: Any) -> Any:
    state = attach_state.state(module if isinstance(module, nn.Module) else module[0])
    state.bind(unit, **bind_options)
    return module


# torch's composable-API registry keys an API by its function's name.
_attach_state.__name__ = "fully_shard"
attach_state = contract(state_cls=FullyShardState)(_attach_state)
"""``contract`` also checks that no FQN changed."""


def state_of(module: nn.Module) -> Optional[FullyShardState]:
    state = attach_state.state(module)
    return state if isinstance(state, FullyShardState) and state.unit is not None else None


def own_state(module: object) -> FullyShardState:
    """The state of an annotated module."""
    state = state_of(module)  # type: ignore[arg-type]
    if state is None:
        raise AssertionError(f"{type(module).__name__} has no fully_shard state")
    return state


def states_at(module: object, recurse: bool) -> list[FullyShardState]:
    """``module``'s state, and with ``recurse`` every state below it."""
    return states_below((module,)) if recurse else [own_state(module)]  # type: ignore[arg-type]


def units_below(module: nn.Module) -> list[Unit]:
    """In module order."""
    return [state.unit for state in states_below((module,)) if state.unit is not None]


def states_below(modules: tuple[nn.Module, ...]) -> list[FullyShardState]:
    """Once each, in module order."""
    seen: dict[int, FullyShardState] = {}
    for top in modules:
        for sub in top.modules():
            state = state_of(sub)
            if state is not None and id(state) not in seen:
                seen[id(state)] = state
    return list(seen.values())


def _name_units(roots: tuple[nn.Module, ...], states: list[FullyShardState]) -> None:
    names: dict[nn.Module, str] = {}
    for top in roots:
        for name, sub in top.named_modules():
            names.setdefault(sub, name)
    for state in states:
        first = state.unit.modules[0]
        label = names.get(first, "")
        state.unit.name = f"'{label}' ({user_class_name(first)})" if label else \
            f"{ROOT_LABEL} ({user_class_name(first)})"


def _check_devices(states: list[FullyShardState]) -> None:
    """Every unit holding parameters computes on one device."""
    holding = [state.unit for state in states if state.unit.buffers]
    for unit in holding[1:]:
        if unit.group.device != holding[0].group.device:
            raise ValueError(
                f"fully_shard units of one model must compute on one device: {holding[0].name} "
                f"uses {holding[0].group.device} but {unit.name} uses {unit.group.device}. "
                "Pass the same mesh (or none) to every fully_shard call.")


def _check_ties_inside(states: list[FullyShardState]) -> None:
    """[Note: tied parameters across units] in ``tied.py``."""
    units = {id(state.unit) for state in states}
    for state in states:
        for tie in state.unit.ties:
            if id(tie.owner) not in units or id(tie.borrower) not in units:
                outside = tie.borrower if id(tie.owner) in units else tie.owner
                raise ValueError(
                    f"parameter '{tie.fqn}' is the same tensor as '{tie.owner_fqn}' (tied "
                    f"weights), but the units holding them are not in one model: "
                    f"{outside.name} is outside the model whose root is {states[0].unit.name}. "
                    "A tied parameter can be shared by units of one model only: annotate a common "
                    "ancestor of both modules last (e.g. fully_shard(model)), so it is their root.")


def pending_model_settings(states: list[FullyShardState]) -> ModelSettings:
    """Pending model-wide changes in module order (conflicts raise)."""
    settings = ModelSettings()
    for state in reversed(states):
        settings.change_all(state.pending_settings)
    return settings


def _layout_fingerprint(units: list[Unit]) -> int:
    return fingerprint_of(repr([[(r.fqn, tuple(r.shape), str(r.param.dtype),
                                  r.param.requires_grad, b.is_meta, repr(r.placement))
                                 for b in u.buffers for r in b.records] for u in units]))


def _check_ranks_agree(states: list[FullyShardState]) -> None:
    """Every rank raises together if the layouts differ (else the first
    all-gather would hang)."""
    by_group: dict[int, list[FullyShardState]] = {}
    for state in states:
        by_group.setdefault(state.unit.group.key, []).append(state)
    for group_states in by_group.values():
        units = [s.unit for s in group_states]
        group = units[0].group
        mine = _layout_fingerprint(units)
        differ = disagreement(mine, group)
        if differ is not None:
            raise RuntimeError(
                f"[rank {group.rank}] ranks disagree on the parameters of the fully_shard units "
                f"{[u.name for u in units]}: ranks {differ.differing} have different names, "
                f"shapes, dtypes, placements or meta-ness than rank {differ.reference} (this rank's "
                f"fingerprint {mine:#x}). Build the same model on every rank before calling "
                "fully_shard (and materialise meta parameters on every rank before the first "
                "forward).")
        for state in group_states:
            state.validated = True
