"""The flat optimizer step: the optimizer steps each flat buffer's shard as a few tensors instead
of one per parameter, with the same numbers.

It is the default: from the second step of an optimizer over managed parameters (a global step
pre-hook), its steps are flat, adopting the state torch's first step made.
``flat_step(optimizer)`` does it at once; ``flat_step(optimizer, enabled=False)`` keeps
torch's own step.

A managed parameter is a view of its buffer's shard and its ``.grad`` a view of one flat
sharded gradient, so the parameters of a family of param groups (``rules.py``) that lie back
to back in a shard are stepped as one tensor per run (``segments.py``), by one call into
torch's own functional optimizer per family. Every element gets the same arithmetic (the same
kernels, foreach or for-loop as torch chooses), so the values are bitwise torch's; what is
saved is the per-tensor cost. The state stays per parameter (views of flat state tensors), so
``state_dict()``, DCP and FSDP2 checkpoints see what they always see.

Anything else goes to torch's own step: unmanaged parameters, a ``.grad`` set by hand, state
that does not look like this optimizer's, groups with ``fused``, ``capturable``,
``differentiable``, a tensor ``lr`` or a GradScaler's fused unscale (warned once), and wholly
other optimizer classes or an instance whose ``step`` other code replaced. An LR scheduler
made before keeps working. A parameter whose ``.grad`` is ``None`` is not touched.
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
"""Where an optimizer keeps its handle: on the instance, so the handle and the model its segments
reach die with the optimizer in one garbage collection."""


def _handle_of(optimizer: Optimizer) -> "Optional[FlatStep]":
    return optimizer.__dict__.get(_HANDLE_ATTRIBUTE)


_OFF: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
_SEEN: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
_installed: list[object] = []  # the default's global step pre-hook, once installed


class StepReport(NamedTuple):
    """What the last step did.

    Attributes:
        flat_tensors: tensors the flat path passed to torch's functional step.
        flat_params: parameters stepped through them.
        torch_params: parameters with a gradient left to torch's own step.
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
        """Why torch steps this optimizer alone (``None``: supported)."""
        self.active: bool = why_not is None
        self.last: Optional[StepReport] = None
        """What the last step did (``None``: no step yet)."""
        step = type(optimizer).step
        self._torch_step: Callable[..., Any] = getattr(step, "__wrapped__", step)
        """torch's step without the hook wrapper (the wrapper around the flat step runs the
        hooks)."""
        self._params_signature: Optional[tuple] = None
        """Per param group, its params list's identity and length."""
        self._signature: Optional[tuple] = None
        self._families: tuple[tuple[int, ...], ...] = ()
        """Param groups stepped together (indices)."""
        self._segments: list[list[Segment]] = []
        self._foreach: list[bool] = []
        """Per param group, torch's foreach choice for ``foreach=None``."""
        self._where: dict[int, tuple[Segment, int]] = {}
        """id(parameter) -> (segment, member)."""
        self._warned: set[str] = set()
        self.installed: Optional[Callable[..., Any]] = None
        self.after_scheduler: bool = False
        """It replaced an LR scheduler's wrapper of torch's step."""

    def remove(self) -> None:
        """Step with torch's own step from now on (the state stays valid)."""
        self.active = False
        optimizer = self._optimizer()
        if optimizer is not None and _handle_of(optimizer) is self:
            del optimizer.__dict__[_HANDLE_ATTRIBUTE]
            _uninstall(optimizer, self)

    def _foreach_of(self, group: dict, index: int) -> bool:
        return choose_foreach(group, ()) if group.get("foreach") is not None \
            else self._foreach[index]

    def _plan(self, optimizer: Optimizer, supported: list[int]) -> None:
        """Families of the supported groups and their segments (made again when they change, or a
        buffer's shard)."""
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
        """The hyperparameters of the family's one call; where its groups differ in a weight
        decay the rule applies itself, apply each group's first and step with none."""
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
        """torch's own step on every parameter the flat path did not take; returns how many have
        a gradient."""
        groups = optimizer.param_groups
        rest = [group["params"] if done is None else [p for p in group["params"] if id(p) not in done]
                for group, done in zip(groups, handled)]
        with_grad = [p for params in rest for p in params if p.grad is not None]
        if not with_grad:
            return 0
        for param in with_grad:  # torch steps its state: no longer known to match the segment's
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
"""The flat step inside torch's hook wrapper (step hooks run around it)."""


def _why_not(optimizer: Optimizer) -> Optional[str]:
    """Why ``optimizer`` cannot step flat at all (``None``: it can)."""
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
    """Make the handle and put the flat step on the instance in the form of an LR scheduler's
    wrapper: it holds the optimizer weakly (no reference cycle), and a scheduler made later
    sees it as its own."""
    handle = FlatStep(optimizer, rule_for(optimizer), None)
    optimizer.__dict__[_HANDLE_ATTRIBUTE] = handle
    handle.after_scheduler = "step" in optimizer.__dict__
    optimizer.step = handle.installed = lr_scheduler_step(optimizer, _hooked_flat_step)
    return handle


def _uninstall(optimizer: Optimizer, handle: FlatStep) -> None:
    """Put the optimizer's step back to torch's (a scheduler's wrapper made before becomes its
    wrapper of torch's)."""
    if optimizer.__dict__.get("step") is not handle.installed:
        return  # other code replaced it since: leave theirs
    if handle.after_scheduler:
        optimizer.step = lr_scheduler_step(optimizer, type(optimizer).step)
    else:
        del optimizer.__dict__["step"]


def flat_step(optimizer: Optimizer, enabled: bool = True) -> FlatStep:
    """Step ``optimizer``'s managed parameters as a few flat tensors per buffer, bitwise the
    numbers of torch's own step. The default does this from an optimizer's second step on;
    calling it makes the first step flat too. Returns the handle (``FlatStep.last`` reports
    each step).

    Supported: ``torch.optim.AdamW``, ``Adam`` and ``SGD`` (foreach or for-loop, every
    hyperparameter but ``fused``/``capturable``/``differentiable``). Anything else keeps
    torch's step with a warning (``FlatStep.unsupported`` says why). Idempotent.
    ``enabled=False``: this optimizer keeps torch's own step and an installed flat step is
    removed."""
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
    """Register the global step pre-hook that gives optimizers over managed parameters the flat
    step (once per process)."""
    if not _installed:
        _installed.append(register_optimizer_step_pre_hook(_take_by_default))


def _take_by_default(optimizer: Optimizer, args: object, kwargs: object) -> None:
    if optimizer in _SEEN:  # one set lookup per step after the first
        return
    _SEEN.add(optimizer)
    if optimizer in _OFF or _handle_of(optimizer) is not None:
        return  # the user decided
    if not any(owner_of(p) is not None for g in optimizer.param_groups for p in g["params"]):
        return  # not a fully_shard model's optimizer
    why_not = _why_not(optimizer)
    if why_not is not None:
        warnings.warn(f"fsdp_compose: {why_not}: the optimizer keeps torch's own step, one "
                      "tensor per parameter (fsdp_compose.flat_step(optimizer, enabled=False) "
                      "before its first step silences this).", stacklevel=4)
        return
    _install(optimizer)  # from the next step on
