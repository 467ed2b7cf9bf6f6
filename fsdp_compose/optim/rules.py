"""What the flat optimizer step knows of each torch optimizer: which groups it
takes, the per-element state, and the call into torch's functional
implementation with one tensor per run.

These optimizers update every element from the same element of parameter,
gradient and state, so one call on a run writes the bits of the per-parameter
calls. Groups differing only in what a rule applies itself step as one
*family*: AdamW's decoupled decay is applied per group first, then the
family steps with ``weight_decay=0``.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch.optim import Optimizer

from .._torch_private import default_to_fused_or_foreach, foreach_mul_

# Looked up at each call, as torch's step does.
_ADAM = importlib.import_module("torch.optim.adam")
_SGD = importlib.import_module("torch.optim.sgd")


class RunTensors(NamedTuple):
    """One run's values, gradients and per-element states (``None``: made from the gradient at
    the first step)."""

    param: torch.Tensor
    grad: torch.Tensor
    states: dict[str, Optional[torch.Tensor]]
    step: Optional[torch.Tensor]


class Rule:
    """One optimizer class: what a group needs, its state, how to call torch's functional step."""

    counts_steps: bool = False
    hyperparameters: tuple[str, ...] = ()

    def separate_decay(self, group: dict[str, Any]) -> bool:
        """The group's weight decay is applied by :meth:`decay`."""
        return False

    def family_key(self, group: dict[str, Any], foreach: bool) -> tuple:
        names = self.hyperparameters if self.separate_decay(group) \
            else self.hyperparameters + ("weight_decay",)
        return (foreach, self.separate_decay(group)) + tuple(_comparable(group.get(k)) for k in names)

    def decay(self, group: dict[str, Any], params: Sequence[torch.Tensor], foreach: bool) -> None:
        """Apply the group's weight decay to ``params`` as torch's functional step does first."""
        raise NotImplementedError

    def unsupported(self, optimizer: Optimizer, group: dict[str, Any]) -> Optional[str]:
        """Why this group must be stepped by torch (``None``: it can run flat)."""
        for key in ("differentiable", "capturable", "fused"):
            if group.get(key):
                return f"{key}=True"
        if isinstance(group.get("lr"), torch.Tensor):
            return "a tensor lr"
        if getattr(optimizer, "grad_scale", None) is not None or \
                getattr(optimizer, "found_inf", None) is not None:
            return "a GradScaler's fused unscale (grad_scale/found_inf)"
        return None

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        raise NotImplementedError

    def fresh_state_from_grad(self) -> bool:
        return False

    def step(self, group: dict[str, Any], runs: Sequence[RunTensors], foreach: bool) -> list:
        """One functional call over every run; per run, the state tensors torch made."""
        raise NotImplementedError


def _comparable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, (tuple, list)):
        return tuple(map(_comparable, value))
    return value


def choose_foreach(group: dict[str, Any], params: Sequence[torch.Tensor]) -> bool:
    """foreach or for-loop as torch decides it (they are not bitwise equal)."""
    if group.get("foreach") is not None:
        return bool(group["foreach"])
    return default_to_fused_or_foreach(list(params), False, use_fused=False)[1]


class AdamRule(Rule):

    counts_steps = True
    hyperparameters = ("lr", "betas", "eps", "amsgrad", "maximize", "decoupled_weight_decay")

    def __init__(self, decoupled: bool) -> None:
        self.decoupled: bool = decoupled

    def separate_decay(self, group: dict[str, Any]) -> bool:
        return bool(group.get("decoupled_weight_decay", self.decoupled))

    def decay(self, group: dict[str, Any], params: Sequence[torch.Tensor], foreach: bool) -> None:
        lr, weight_decay = group["lr"], group["weight_decay"]
        if weight_decay == 0:
            return  # torch skips it too
        if foreach:
            foreach_mul_(list(params), 1 - lr * weight_decay)
        else:
            for param in params:
                param.mul_(1 - lr * weight_decay)

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        extra = ("max_exp_avg_sq",) if group["amsgrad"] else ()
        return ("exp_avg", "exp_avg_sq") + extra

    def step(self, group: dict[str, Any], runs: Sequence[RunTensors], foreach: bool) -> list:
        beta1, beta2 = group["betas"]
        amsgrad = group["amsgrad"]
        _ADAM.adam(
            [r.param for r in runs], [r.grad for r in runs],
            [r.states["exp_avg"] for r in runs], [r.states["exp_avg_sq"] for r in runs],
            [r.states["max_exp_avg_sq"] for r in runs] if amsgrad else [],
            [r.step for r in runs],
            foreach=foreach, capturable=False, differentiable=False, fused=None,
            grad_scale=None, found_inf=None, has_complex=False,
            decoupled_weight_decay=group.get("decoupled_weight_decay", self.decoupled),
            amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
        return [None] * len(runs)


class SGDRule(Rule):

    hyperparameters = ("lr", "momentum", "dampening", "nesterov", "maximize")

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def fresh_state_from_grad(self) -> bool:
        return True

    def step(self, group: dict[str, Any], runs: Sequence[RunTensors], foreach: bool) -> list:
        momentum = group["momentum"]
        buffers = [r.states.get("momentum_buffer") for r in runs]
        _SGD.sgd(
            [r.param for r in runs], [r.grad for r in runs], buffers,
            weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
            dampening=group["dampening"], nesterov=group["nesterov"],
            maximize=group["maximize"], has_sparse_grad=False, foreach=foreach, fused=None,
            grad_scale=None, found_inf=None)
        return buffers  # a first step's buffers: torch's clone of the gradient


def rule_for(optimizer: Optimizer) -> Optional[Rule]:
    """The rule for this exact class (``None``: a subclass may step differently)."""
    cls = type(optimizer)
    if cls is torch.optim.AdamW:
        return AdamRule(decoupled=True)
    if cls is torch.optim.Adam:
        return AdamRule(decoupled=False)
    if cls is torch.optim.SGD:
        return SGDRule()
    return None
