"""``flat_step(optimizer)``: the optimizer steps each flat buffer's shard as
a few tensors instead of one per parameter, with the same numbers.

Between iterations a managed parameter's values are its view of its flat
buffer's shard, and after backward its ``.grad`` is its view of one flat
sharded gradient (``buffers/flat_grad.py``). So the parameters of one param
group that lie back to back in a shard can be stepped as one tensor: one
call into torch's own functional optimizer (``torch.optim.adam.adam``,
``torch.optim.sgd.sgd``) per param group, with one tensor per run
(``segments.py``) where torch's step passes one per parameter. Every
element gets the same arithmetic (the same kernels, foreach or for-loop as
torch would choose), so the values are bitwise those of torch's own step;
what is saved is the per-tensor cost (kernel launches, Python, foreach
list handling), which dominates on many small parameters.

The optimizer's state stays per parameter: each parameter's ``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq`` or ``momentum_buffer`` is a view of a
flat state tensor of its segment, its ``step`` its own 0-dim tensor, so
``state_dict()``, ``load_state_dict()``, DCP and FSDP2 checkpoints see what
they always see. State loaded into the optimizer is copied into the flat
state at the next step (*adopted*).

Anything else goes to torch's own step, for the parameters concerned:
parameters ``fully_shard`` does not manage, a ``.grad`` that is not the
parameter's piece of the flat gradient (set by hand), state that does not
look like this optimizer's, and whole groups with ``fused``,
``capturable``, ``differentiable``, a tensor ``lr``, or a GradScaler's
fused unscale (each said once in a warning); other optimizer classes
(subclasses too) entirely. A parameter whose ``.grad`` is ``None`` is not
touched, as torch does not touch it.
"""

from __future__ import annotations

import types
import warnings
import weakref
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.autograd.graph import increment_version
from torch.optim import Optimizer

from .._torch_private import foreach_add_
from ..runtime.owners import owner_of
from .rules import Rule, choose_foreach, rule_for
from .segments import Segment, build_segments, is_flat_view, member_ids

_HANDLES: "weakref.WeakKeyDictionary[Optimizer, FlatStep]" = weakref.WeakKeyDictionary()


class StepReport(NamedTuple):
    """What the last step did.

    Attributes:
        flat_tensors: tensors the flat path passed to torch's functional step
            (per state: one per run; a run is one or more parameters).
        flat_params: parameters stepped through them.
        torch_params: parameters with a gradient left to torch's own step.
        reasons: why whole groups went to torch's step (empty: none did).
    """

    flat_tensors: int
    flat_params: int
    torch_params: int
    reasons: tuple[str, ...]


class FlatStep:
    """The flat step of one optimizer (see the module note). Made by
    :func:`flat_step`; :meth:`remove` returns the optimizer to torch's step."""

    def __init__(self, optimizer: Optimizer, rule: Optional[Rule], why_not: Optional[str]) -> None:
        self._optimizer: "weakref.ref[Optimizer]" = weakref.ref(optimizer)
        self.rule: Optional[Rule] = rule
        self.unsupported: Optional[str] = why_not
        """Why this optimizer is stepped by torch only (``None``: supported)."""
        self.active: bool = why_not is None
        self.last: Optional[StepReport] = None
        """What the last step did (``None``: no step yet)."""
        step = type(optimizer).step
        self._torch_step: Callable[..., Any] = getattr(step, "__wrapped__", step)
        """torch's step without the hook wrapper (the wrapper around the flat step runs the hooks)."""
        self._signature: Optional[tuple] = None
        self._segments: list[list[Segment]] = []
        """Per param group, its segments."""
        self._foreach: list[bool] = []
        """Per param group, torch's foreach choice for ``foreach=None``."""
        self._where: dict[int, tuple[Segment, int]] = {}
        """id(parameter) -> (segment, member) of every parameter in a segment."""
        self._warned: set[str] = set()

    def remove(self) -> None:
        """Step with torch's own step from now on (state stays valid: views)."""
        self.active = False
        optimizer = self._optimizer()
        if optimizer is not None:
            _HANDLES.pop(optimizer, None)
            if getattr(optimizer.__dict__.get("step"), "__func__", None) is _hooked_flat_step:
                del optimizer.__dict__["step"]

    # ------------------------------------------------------------ plan
    def _plan(self, optimizer: Optimizer) -> None:
        groups = optimizer.param_groups
        signature = tuple((id(g["params"]), len(g["params"])) for g in groups)
        if signature == self._signature and all(
                seg.sharded is seg.buffer.sharded for segs in self._segments for seg in segs):
            return
        self._signature, self._segments, self._foreach, self._where = signature, [], [], {}
        for group in groups:
            by_buffer: dict[int, tuple[Any, list]] = {}
            for param in group["params"]:
                owner = owner_of(param)
                if owner is not None and is_flat_view(owner.buffer, owner.index, param):
                    by_buffer.setdefault(id(owner.buffer), (owner.buffer, []))[1].append(
                        (owner.index, param))
            segments = [seg for buffer, members in by_buffer.values()
                        for seg in build_segments(buffer, members)]
            self._segments.append(segments)
            self._foreach.append(choose_foreach({"foreach": None}, group["params"]))
            for seg in segments:
                for member, param in enumerate(seg.params):
                    self._where[id(param)] = (seg, member)

    # ------------------------------------------------------------ step
    def step(self, optimizer: Optimizer, closure: Optional[Callable[[], Any]]) -> Any:
        if not self.active:
            return self._torch_step(optimizer, closure)
        loss = None
        if closure is not None:  # as torch's step: gradients first
            with torch.enable_grad():
                loss = closure()
        self._plan(optimizer)
        rule, state = self.rule, optimizer.state
        handled: list[Optional[set[int]]] = []
        later_steps: list[torch.Tensor] = []
        stepped: list[torch.Tensor] = []
        reasons: list[str] = []
        tensors_passed = 0
        with torch.no_grad():
            for index, group in enumerate(optimizer.param_groups):
                reason = rule.unsupported(optimizer, group)
                if reason is not None:
                    reasons.append(f"param group {index}: {reason}")
                    handled.append(None)
                    continue
                names = rule.state_names(group)
                work = []
                for segment in self._segments[index]:
                    base, runs = segment.collect(rule, names, state)
                    work.extend((run, base) for run in runs)
                if not work:
                    handled.append(None)
                    continue
                runs_tensors = [run.segment.tensors(run, base, rule, names) for run, base in work]
                foreach = choose_foreach(group, ()) if group.get("foreach") is not None \
                    else self._foreach[index]
                handed_back = rule.step(group, runs_tensors, foreach)
                for (run, _), back in zip(work, handed_back):
                    new = {names[0]: back} if run.age < 0 and back is not None else None
                    run.segment.finish(run, new, names, rule, state, later_steps)
                    stepped.extend(run.segment.params[run.first:run.last + 1])
                for segment in {id(run.segment): run.segment for run, _ in work}.values():
                    segment.settle(names, rule)
                tensors_passed += len(work)
                handled.append(member_ids(r for r, _ in work))
            if later_steps:
                foreach_add_(later_steps, 1.0)
            if stepped:  # the values changed behind the parameters' backs: say so to autograd
                increment_version(stepped)
        left = self._torch_rest(optimizer, handled)
        self.last = StepReport(tensors_passed, len(stepped), left, tuple(reasons))
        for reason in reasons:
            self._warn_once(reason)
        return loss

    def _torch_rest(self, optimizer: Optimizer, handled: list[Optional[set[int]]]) -> int:
        """torch's own step on every parameter the flat path did not take;
        returns how many of them have a gradient."""
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
    handle = _HANDLES.get(optimizer)
    if handle is None:  # removed, but something (an LR scheduler) still calls this wrapper
        return type(optimizer).step.__wrapped__(optimizer, closure)
    return handle.step(optimizer, closure)


_hooked_flat_step = Optimizer.profile_hook_step(_flat_step)
"""The flat step inside torch's hook wrapper: step pre- and post-hooks, global
and per optimizer, run around it as around torch's own step."""


def flat_step(optimizer: Optimizer) -> FlatStep:
    """Step ``optimizer``'s managed parameters as a few flat tensors per
    buffer (see the module note): bitwise the numbers of torch's own step.

    Supported: ``torch.optim.AdamW``, ``Adam`` and ``SGD`` (foreach or
    for-loop; weight decay, ``maximize``, ``amsgrad``, momentum, dampening,
    nesterov, per-group hyperparameters). Anything else falls back to
    torch's step with a warning (``FlatStep.unsupported`` says why).
    Idempotent. Call it right after making the optimizer: it replaces
    ``optimizer.step`` (keeping its hooks), so it must come before anything
    that wraps the step (an LR scheduler)."""
    if optimizer in _HANDLES:
        return _HANDLES[optimizer]
    rule = rule_for(optimizer)
    step = type(optimizer).step
    why_not = None
    if rule is None:
        why_not = f"{type(optimizer).__name__} (flat steps exist for AdamW, Adam and SGD)"
    elif not (getattr(step, "hooked", False) and hasattr(step, "__wrapped__")):
        why_not = f"{type(optimizer).__name__}.step is not torch's hooked step"
    if why_not is not None:
        warnings.warn(f"fsdp_compose.flat_step: {why_not}; the optimizer keeps torch's own "
                      "step.", stacklevel=2)
        return FlatStep(optimizer, None, why_not)
    if "step" in optimizer.__dict__:
        raise ValueError(
            f"fsdp_compose.flat_step: this {type(optimizer).__name__}'s step was already "
            "replaced on the instance (an LR scheduler wraps it when it is made). Call "
            "fsdp_compose.flat_step(optimizer) right after making the optimizer, before the "
            "LR scheduler.")
    handle = FlatStep(optimizer, rule, None)
    _HANDLES[optimizer] = handle
    optimizer.step = types.MethodType(_hooked_flat_step, optimizer)
    return handle
