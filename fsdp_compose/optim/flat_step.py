"""The flat optimizer step: each flat buffer's shard is stepped as a few tensors instead of one
per parameter, bitwise with torch's numbers (the default from an optimizer's second step on).

Parameters of a family of param groups (``rules.py``) lying back to back are stepped as one
tensor per run (``segments.py``) by one call into torch's own functional optimizer. The state
stays per parameter (views of flat state tensors), so state dicts are unchanged. What it
cannot take goes to torch's step (:attr:`StepReport.reasons`). The default's first step is
torch's own, into flat state laid out beforehand.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.autograd.graph import increment_version
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._torch_private import foreach_add_, is_lr_scheduler_step, lr_scheduler_step
from ..runtime.owners import owner_of
from .rules import Rule, choose_foreach, rule_for
from .segments import Member, Segment, build_segments, is_flat_view, member_ids

_HANDLE_ATTRIBUTE = "_fsdp_compose_flat_step"
"""On the instance, so the handle dies with the optimizer."""


def _handle_of(optimizer: Optimizer) -> "Optional[FlatStep]":
    return optimizer.__dict__.get(_HANDLE_ATTRIBUTE)


_OFF: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
_SEEN: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
_installed: list[object] = []


class StepReport(NamedTuple):
    """What the last step did.

    Attributes:
        flat_tensors: tensors passed to torch's functional step.
        flat_params: parameters stepped through them.
        torch_params: parameters with a gradient left to torch's step.
        reasons: why whole groups went to torch's step."""

    flat_tensors: int
    flat_params: int
    torch_params: int
    reasons: tuple[str, ...]


class FlatStep:
    """The flat step of one optimizer, made by :func:`flat_step`; :meth:`remove` returns it to
    torch's step."""

    def __init__(self, optimizer: Optimizer, rule: Optional[Rule], why_not: Optional[str]) -> None:
        self._optimizer: "weakref.ref[Optimizer]" = weakref.ref(optimizer)
        self.rule: Optional[Rule] = rule
        self.unsupported: Optional[str] = why_not
        self.active: bool = why_not is None
        self.last: Optional[StepReport] = None
        step = type(optimizer).step
        self._torch_step: Callable[..., Any] = getattr(step, "__wrapped__", step)
        """torch's step without its hook wrapper (ours runs the hooks)."""
        self._params_signature: Optional[tuple] = None
        self._signature: Optional[tuple] = None
        self._families: tuple[tuple[int, ...], ...] = ()
        self._segments: list[list[Segment]] = []
        self._foreach: list[bool] = []
        self._where: dict[int, tuple[Segment, int]] = {}
        self._warned: set[str] = set()
        self.installed: Optional[Callable[..., Any]] = None
        self.after_scheduler: bool = False
        """It replaced an LR scheduler's wrapper of torch's step."""

    def remove(self) -> None:
        self.active = False
        optimizer = self._optimizer()
        if optimizer is not None and _handle_of(optimizer) is self:
            del optimizer.__dict__[_HANDLE_ATTRIBUTE]
            _uninstall(optimizer, self)

    def _foreach_of(self, group: dict, index: int) -> bool:
        return choose_foreach(group, ()) if group.get("foreach") is not None \
            else self._foreach[index]

    def _plan(self, optimizer: Optimizer, supported: list[int]) -> None:
        """Families and segments of the supported groups, rebuilt when groups or a
        shard change."""
        groups, rule = optimizer.param_groups, self.rule
        params_signature = tuple((id(g["params"]), len(g["params"])) for g in groups)
        if params_signature != self._params_signature:
            self._params_signature = params_signature
            self._foreach = [choose_foreach({"foreach": None}, g["params"]) for g in groups]
        families: dict[tuple, list[int]] = {}
        for index in supported:
            group = groups[index]
            families.setdefault(rule.family_key(group, self._foreach_of(group, index)),
                                []).append(index)
        signature = (params_signature, tuple(map(tuple, families.values())))
        if signature == self._signature and all(
                seg.sharded is seg.buffer.sharded for segs in self._segments for seg in segs):
            return
        self._signature, self._families = signature, signature[1]
        self._segments, self._where = [], {}
        for family in self._families:
            by_buffer: dict[int, tuple[Any, list[Member]]] = {}
            for index in family:
                for param in groups[index]["params"]:
                    owner = owner_of(param)
                    if owner is not None and is_flat_view(owner.buffer, owner.index, param):
                        by_buffer.setdefault(id(owner.buffer), (owner.buffer, []))[1].append(
                            Member(owner.index, param, index))
            segments = [seg for buffer, members in by_buffer.values()
                        for seg in build_segments(buffer, members)]
            self._segments.append(segments)
            for seg in segments:
                for member, param in enumerate(seg.params):
                    self._where[id(param)] = (seg, member)

    def lay_state_for_torchs_first_step(self, optimizer: Optimizer) -> None:
        """Before torch's own first step: every managed parameter about to be
        stepped gets that step's state as views of the flat state, so the state
        is never held twice. SGD is left alone (its momentum starts as torch's
        clone of the gradient)."""
        rule, groups, state = self.rule, optimizer.param_groups, optimizer.state
        if not rule.counts_steps:
            return
        self._plan(optimizer, [i for i, g in enumerate(groups) if rule.unsupported(optimizer, g) is None])
        for family, segments in zip(self._families, self._segments):
            names = rule.state_names(groups[family[0]])
            for segment in segments:
                for member, param in enumerate(segment.params):
                    if param.grad is not None and not state.get(param):
                        segment.lay_first_state(member, names, state)

    # ------------------------------------------------------------ step
    def step(self, optimizer: Optimizer, closure: Optional[Callable[[], Any]]) -> Any:
        if not self.active:
            return self._torch_step(optimizer, closure)
        loss = None
        if closure is not None:  # as torch's step: gradients first
            with torch.enable_grad():
                loss = closure()
        rule, state, groups = self.rule, optimizer.state, optimizer.param_groups
        reasons: list[str] = []
        supported: list[int] = []
        for index, group in enumerate(groups):
            reason = rule.unsupported(optimizer, group)
            if reason is None:
                supported.append(index)
            else:
                reasons.append(f"param group {index}: {reason}")
        self._plan(optimizer, supported)
        handled: dict[int, set[int]] = {}
        later_steps: list[torch.Tensor] = []
        stepped: list[torch.Tensor] = []
        tensors_passed = 0
        with torch.no_grad():
            for family, segments in zip(self._families, self._segments):
                group = groups[family[0]]
                names = rule.state_names(group)
                work = []
                for segment in segments:
                    base, runs = segment.collect(rule, names, state)
                    work.extend((run, base) for run in runs)
                if not work:
                    continue
                runs_tensors = [run.segment.tensors(run, base, rule, names) for run, base in work]
                foreach = self._foreach_of(group, family[0])
                handed_back = rule.step(self._decayed(groups, family, work, foreach),
                                        runs_tensors, foreach)
                for (run, _), back in zip(work, handed_back):
                    new = {names[0]: back} if run.age < 0 and back is not None else None
                    run.segment.finish(run, new, names, rule, state, later_steps)
                    stepped.extend(run.segment.params[run.first:run.last + 1])
                for segment in {id(run.segment): run.segment for run, _ in work}.values():
                    segment.settle(names, rule)
                tensors_passed += len(work)
                ids = member_ids(r for r, _ in work)
                handled.update((index, ids) for index in family)
            if later_steps:
                foreach_add_(later_steps, 1.0)
            if stepped:  # changed behind the parameters' backs: tell autograd
                increment_version(stepped)
        left = self._torch_rest(optimizer, [handled.get(i) for i in range(len(groups))])
        self.last = StepReport(tensors_passed, len(stepped), left, tuple(reasons))
        for reason in reasons:
            self._warn_once(reason)
        return loss

    def _decayed(self, groups: list[dict], family: tuple[int, ...], work: list,
                 foreach: bool) -> dict:
        """The family's call's hyperparameters; a weight decay that differs within
        the family is applied per group first."""
        group = groups[family[0]]
        if len(family) == 1 or not self.rule.separate_decay(group) or \
                all(groups[i]["weight_decay"] == group["weight_decay"] for i in family):
            return group
        pieces: dict[int, list[torch.Tensor]] = {}
        for run, _ in work:
            for index, values in run.segment.values_by_group(run):
                pieces.setdefault(index, []).append(values)
        for index, values in pieces.items():
            self.rule.decay(groups[index], values, foreach)
        return dict(group, weight_decay=0.0)

    def _torch_rest(self, optimizer: Optimizer, handled: list[Optional[set[int]]]) -> int:
        """torch's step on the parameters the flat path did not take; returns how
        many have a gradient."""
        groups = optimizer.param_groups
        rest = [group["params"] if done is None else [p for p in group["params"] if id(p) not in done]
                for group, done in zip(groups, handled)]
        with_grad = [p for params in rest for p in params if p.grad is not None]
        if not with_grad:
            return 0
        for param in with_grad:  # torch steps its state now
            found = self._where.get(id(param))
            if found is not None:
                found[0].forget(found[1])
        originals = [group["params"] for group in groups]
        try:
            for group, params in zip(groups, rest):
                group["params"] = params
            self._torch_step(optimizer)
        finally:
            for group, params in zip(groups, originals):
                group["params"] = params
        return len(with_grad)

    def _warn_once(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"fsdp_compose.flat_step: {reason} is not supported by the flat "
                          "optimizer step; that group is stepped by torch's own step "
                          "(the same numbers, one tensor per parameter).", stacklevel=5)


def _flat_step(optimizer: Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
    handle = _handle_of(optimizer)
    if handle is None:  # removed, but an LR scheduler still calls this wrapper
        return type(optimizer).step.__wrapped__(optimizer, closure)
    return handle.step(optimizer, closure)


_hooked_flat_step = Optimizer.profile_hook_step(_flat_step)


def _why_not(optimizer: Optimizer) -> Optional[str]:
    name = type(optimizer).__name__
    if rule_for(optimizer) is None:
        return f"{name} (flat steps exist for AdamW, Adam and SGD; not their subclasses)"
    step = type(optimizer).step
    if not (getattr(step, "hooked", False) and hasattr(step, "__wrapped__")):
        return f"{name}.step is not torch's hooked step"
    replaced = optimizer.__dict__.get("step")
    if replaced is not None and not is_lr_scheduler_step(replaced):
        return f"this {name}'s step was replaced on the instance by other code"
    return None


def _install(optimizer: Optimizer) -> FlatStep:
    """Install as an LR scheduler's wrapper would: holding the optimizer
    weakly, so a later scheduler wraps it."""
    handle = FlatStep(optimizer, rule_for(optimizer), None)
    optimizer.__dict__[_HANDLE_ATTRIBUTE] = handle
    handle.after_scheduler = "step" in optimizer.__dict__
    optimizer.step = handle.installed = lr_scheduler_step(optimizer, _hooked_flat_step)
    return handle


def _uninstall(optimizer: Optimizer, handle: FlatStep) -> None:
    """Back to torch's step."""
    if optimizer.__dict__.get("step") is not handle.installed:
        return  # other code replaced it since: leave theirs
    if handle.after_scheduler:
        optimizer.step = lr_scheduler_step(optimizer, type(optimizer).step)
    else:
        del optimizer.__dict__["step"]


def flat_step(optimizer: Optimizer, enabled: bool = True) -> FlatStep:
    """Step ``optimizer``'s managed parameters as a few flat tensors per
    buffer, bitwise torch's numbers, from its first step on. Returns the
    handle (``FlatStep.last`` reports each step).

    Supported: ``torch.optim.AdamW``, ``Adam`` and ``SGD`` (every
    hyperparameter but ``fused``, ``capturable``, ``differentiable``);
    anything else keeps torch's step with a warning
    (``FlatStep.unsupported``). Idempotent. ``enabled=False``: keep torch's
    step (removing an installed flat step)."""
    if not enabled:
        _OFF.add(optimizer)
        handle = _handle_of(optimizer)
        if handle is not None:
            handle.remove()
        return FlatStep(optimizer, None, "turned off with flat_step(optimizer, enabled=False)")
    _OFF.discard(optimizer)
    handle = _handle_of(optimizer)
    if handle is not None:
        return handle
    why_not = _why_not(optimizer)
    if why_not is not None:
        warnings.warn(f"fsdp_compose.flat_step: {why_not}; the optimizer keeps torch's own "
                      "step.", stacklevel=2)
        return FlatStep(optimizer, None, why_not)
    return _install(optimizer)


def install_default_flat_step() -> None:
    """Register the global step pre-hook that installs the flat step (once per process)."""
    if not _installed:
        _installed.append(register_optimizer_step_pre_hook(_take_by_default))


def _take_by_default(optimizer: Optimizer, args: object, kwargs: object) -> None:
    if optimizer in _SEEN:
        return
    _SEEN.add(optimizer)
    if optimizer in _OFF or _handle_of(optimizer) is not None:
        return
    if not any(owner_of(p) is not None for g in optimizer.param_groups for p in g["params"]):
        return  # not a fully_shard model's optimizer
    why_not = _why_not(optimizer)
    if why_not is not None:
        warnings.warn(f"fsdp_compose: {why_not}: the optimizer keeps torch's own step, one "
                      "tensor per parameter (fsdp_compose.flat_step(optimizer, enabled=False) "
                      "before its first step silences this).", stacklevel=4)
        return
    # flat from the next step on; this one (torch's, under way) writes into flat state
    _install(optimizer).lay_state_for_torchs_first_step(optimizer)
