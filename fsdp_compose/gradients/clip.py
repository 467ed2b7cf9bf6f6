"""Gradient norms over sharded parameters: clipping and per-parameter norms.

Each element of a managed parameter is owned by one rank, so a p-norm is
``(sum over ranks of local sums of |g|^p) ** (1/p)`` (the inf-norm: the max
of local maxima), one scalar all-reduce per distinct set of ranks (plus one
over tp for TP-sharded parameters). Unmanaged parameters are replicated and
counted once (rank 0 adds them). Per-tensor norms are float32 (float64 for
float64 tensors); sums use float64 where the device has it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Iterable, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from .._torch_private import foreach_mul_, foreach_norm, privateuse1_backend_name
from ..buffers.tensor_parallel import norm_process_group
from ..comm.groups import ShardGroup
from ..comm.rendezvous import arrive
from ..runtime.owners import owner_of
from ..runtime.unit import Unit

__all__ = ["clip_grad_norm_", "param_norms"]

ParamsArg = Union[nn.Module, torch.Tensor, Iterable[torch.Tensor]]


@torch.no_grad()
def clip_grad_norm_(module_or_params: ParamsArg, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None) -> torch.Tensor:
    """Clip the gradients of (sharded) parameters by their total norm, in
    place: the drop-in for :func:`torch.nn.utils.clip_grad_norm_`. Every
    gradient is multiplied by ``min(max_norm / (total_norm + 1e-6), 1)``.

    Args:
        module_or_params: a module, one tensor, or an iterable of parameters,
            managed or not; a parameter listed twice counts once.
        max_norm: the largest total norm allowed.
        norm_type: ``p > 0`` of the p-norm, or ``inf``.
        error_if_nonfinite: raise ``RuntimeError`` (on every rank or none) if
            the total norm is nan or inf.
        foreach: use ``torch._foreach_*`` kernels (``None``: where supported).

    Returns:
        The total norm, as on the unsharded model up to rounding, bitwise
        equal on every rank: a float32 0-d tensor on the group's device.

    Collective: every rank calls it with the same parameters; no host sync
    apart from ``error_if_nonfinite``."""
    params = _as_param_list(module_or_params)
    grads = [t.grad for t in params if t.grad is not None]
    total = total_norm_over_ranks(params, norm_type, error_if_nonfinite, foreach)
    if grads:
        clip_coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for (device, _), group in _by_device_and_dtype(grads).items():
            coef = clip_coef.to(device)
            if _use_foreach(foreach, device):
                foreach_mul_(group, coef)
            else:
                for g in group:
                    g.mul_(coef)
    return total


@torch.no_grad()
def total_norm_over_ranks(params: list[torch.Tensor], norm_type: float = 2.0,
                          error_if_nonfinite: bool = False, foreach: Optional[bool] = None,
                          tensors: Optional[list[Optional[torch.Tensor]]] = None,
                          call: str = "fsdp_compose.clip_grad_norm_") -> torch.Tensor:
    """The total norm of :func:`clip_grad_norm_` without clipping, of
    ``tensors[i]`` (default: ``params[i].grad``). Not deduplicated.
    Collective when any is managed; the ranks meet as ``call`` first."""
    p = _check_norm_type(norm_type)
    total = _total_norm(params, p, foreach, tensors, call)
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped (the same on every rank). To disable this "
            "error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`")
    return total


@torch.no_grad()
def param_norms(module_or_params: ParamsArg, kind: str = "grad", norm_type: float = 2.0,
                foreach: Optional[bool] = None
                ) -> Union[dict[str, Optional[torch.Tensor]], list[Optional[torch.Tensor]]]:
    """The full norm of every original parameter (or of its gradient), from the
    local shards.

    Args:
        module_or_params: a module, or an iterable of parameters.
        kind: ``"grad"`` or ``"weight"``.
        norm_type: ``p > 0`` of the p-norm, or ``inf``.
        foreach: as in :func:`clip_grad_norm_`.

    Returns:
        For a module, a dict by ``named_parameters()`` name; for an iterable,
        a list aligned with it. Float32 0-d tensors, the same on every rank;
        with ``kind="grad"``, ``None`` where every rank's gradient is ``None``.

    Collective: one all-reduce per distinct process group; ``kind="grad"``
    syncs the host once."""
    if kind not in ("grad", "weight"):
        raise ValueError(f"param_norms: kind must be 'grad' or 'weight', got {kind!r}")
    p = _check_norm_type(norm_type)
    names: Optional[list[str]] = None
    if isinstance(module_or_params, nn.Module):
        named = list(module_or_params.named_parameters())
        names = [n for n, _ in named]
        params = [t for _, t in named]
    else:
        params = [module_or_params] if isinstance(module_or_params, torch.Tensor) \
            else list(module_or_params)
    unique = _as_param_list(params)
    tensors = [(t.grad if kind == "grad" else t.detach()) for t in unique]
    norms = _per_param_norms(unique, tensors, p, foreach, need_presence=(kind == "grad"))
    by_id = {id(t): n for t, n in zip(unique, norms)}
    result = [by_id[id(t)] for t in params]
    if names is not None:
        return dict(zip(names, result))
    return result


def _check_norm_type(norm_type: float) -> float:
    p = float(norm_type)
    if math.isnan(p) or p <= 0:  # inf is fine, -inf and 0 are not
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    return p


def _as_param_list(params: ParamsArg) -> list[torch.Tensor]:
    if isinstance(params, nn.Module):
        params = params.parameters()
    elif isinstance(params, torch.Tensor):
        params = [params]
    seen: set[int] = set()
    out = []
    for t in params:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected parameters (tensors), got {type(t).__name__}")
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


class _NormGroup(NamedTuple):
    """Managed parameters whose norms are summed over the same ranks."""

    group: ShardGroup
    tp_group: Optional[dist.ProcessGroup]  # TP-sharded parameters: also over tp
    indices: list[int]
    unit: Unit  # whose model says whether to check calls

    def all_reduce(self, vec: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        _all_reduce(vec, op, self.group)
        if self.tp_group is not None and self.tp_group.size() > 1:
            dist.all_reduce(vec, op=op, group=self.tp_group)
        return vec

    @property
    def counts_replicated(self) -> bool:
        """This rank adds the replicated parameters' ``|g|^p``."""
        return self.group.rank == 0 and (self.tp_group is None or self.tp_group.rank() == 0)


def _meet(groups: list[_NormGroup], call: str) -> None:
    """[Note: call rendezvous] before the first all-reduce of ``call``."""
    for norm_group in groups:
        arrive(norm_group.group.process_group, call,
               "Call it on every rank (not under `if rank == 0:`), e.g. right after "
               "backward on every rank, and log its result from rank 0.")


def _group_key(group: ShardGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group.process_group))


def _partition(params: list[torch.Tensor]) -> tuple[list[_NormGroup], list[int]]:
    """Indices of managed parameters per distinct set of ranks to sum over, in
    order of first appearance, and of unmanaged ones."""
    groups: "OrderedDict[tuple, _NormGroup]" = OrderedDict()
    unmanaged: list[int] = []
    for i, t in enumerate(params):
        owner = owner_of(t) if isinstance(t, nn.Parameter) else None
        if owner is None:
            unmanaged.append(i)
            continue
        buffer = owner.buffer
        tp_group = norm_process_group(buffer.records[owner.index].tp)
        key = (_group_key(buffer.group),
               None if tp_group is None else tuple(dist.get_process_group_ranks(tp_group)))
        if key not in groups:
            groups[key] = _NormGroup(buffer.group, tp_group, [], owner.unit)
        groups[key].indices.append(i)
    return list(groups.values()), unmanaged


def _acc_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _norm_dtype(t: torch.Tensor) -> Optional[torch.dtype]:
    if t.dtype == torch.float64:
        return torch.float64
    if t.is_floating_point():
        return torch.float32
    return None  # complex: vector_norm returns a real norm


def _use_foreach(foreach: Optional[bool], device: torch.device) -> bool:
    supported = device.type in ("cpu", "cuda", "xpu", "mtia",
                                privateuse1_backend_name())
    if foreach and not supported:
        raise RuntimeError(
            f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return supported if foreach is None else bool(foreach)


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    out: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


def _local_norms(tensors: list[torch.Tensor], p: float,
                 foreach: Optional[bool]) -> list[torch.Tensor]:
    result: list[Optional[torch.Tensor]] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    for (device, _), idx in groups.items():
        ts = [tensors[i] for i in idx]
        dtype = _norm_dtype(ts[0])
        if _use_foreach(foreach, device):
            norms = foreach_norm(ts, p, dtype=dtype)
        else:
            norms = [torch.linalg.vector_norm(t, p, dtype=dtype) for t in ts]
        for i, n in zip(idx, norms):
            result[i] = n
    return result  # type: ignore[return-value]


def _all_reduce(vec: torch.Tensor, op: dist.ReduceOp, group: ShardGroup) -> torch.Tensor:
    if group.world_size > 1:
        dist.all_reduce(vec, op=op, group=group.process_group)
    return vec


def _max_with_nan_flag(norms: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``[max ignoring nan, 1 if any nan]`` (gloo's MAX does not propagate nan)."""
    acc = _acc_dtype(device)
    if not norms:
        return torch.zeros(2, dtype=acc, device=device)
    stacked = torch.stack([n.to(device=device, dtype=acc) for n in norms])
    nan = stacked.isnan()
    return torch.stack([torch.where(nan, 0.0, stacked).max(), nan.any().to(acc)])


def _pow_sum(norms: list[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    acc = _acc_dtype(device)
    if not norms:
        return torch.zeros(1, dtype=acc, device=device)
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for n in norms:
        per_device.setdefault(n.device, []).append(n)
    total = torch.zeros(1, dtype=acc, device=device)
    for ns in per_device.values():
        total += torch.stack(ns).to(acc).pow(p).sum().to(device)
    return total


def _total_norm(params: list[torch.Tensor], p: float, foreach: Optional[bool],
                tensors: Optional[list[Optional[torch.Tensor]]] = None,
                call: str = "fsdp_compose.clip_grad_norm_") -> torch.Tensor:
    groups, unmanaged = _partition(params)
    local_parts = [t.grad for t in params] if tensors is None else tensors

    def grads_of(indices: list[int]) -> list[torch.Tensor]:
        return [g for g in (local_parts[i] for i in indices) if g is not None and g.numel()]

    _meet(groups, call)
    unmanaged_norms = _local_norms(grads_of(unmanaged), p, foreach)
    if not groups:  # nothing sharded: a local norm
        all_grads = grads_of(list(range(len(params))))
        device = all_grads[0].device if all_grads else torch.device("cpu")
        if math.isinf(p):
            vec = _max_with_nan_flag(unmanaged_norms, device)
            return torch.where(vec[1] > 0, math.nan, vec[0]).float()
        return _pow_sum(unmanaged_norms, p, device).pow(1.0 / p)[0].float()

    parts = []
    for n, norm_group in enumerate(groups):
        device = norm_group.group.device
        local = _local_norms(grads_of(norm_group.indices), p, foreach)
        if math.isinf(p):
            if n == 0:
                local = local + unmanaged_norms
            vec = _max_with_nan_flag(local, device)
            parts.append(norm_group.all_reduce(vec, dist.ReduceOp.MAX))
        else:
            if n == 0 and norm_group.counts_replicated:
                local = local + unmanaged_norms  # replicated: counted once
            parts.append(norm_group.all_reduce(_pow_sum(local, p, device), dist.ReduceOp.SUM))
    device = groups[0].group.device
    if math.isinf(p):
        vec = torch.stack([v.to(device) for v in parts]).amax(dim=0)
        return torch.where(vec[1] > 0, math.nan, vec[0]).float()
    total = parts[0]
    for v in parts[1:]:
        total = total + v.to(device)
    return total.pow(1.0 / p)[0].float()


def _per_param_norms(params: list[torch.Tensor], tensors: list[Optional[torch.Tensor]],
                     p: float, foreach: Optional[bool],
                     need_presence: bool) -> list[Optional[torch.Tensor]]:
    """Full norm of each ``tensors[i]``; one all-reduce per process group."""
    groups, unmanaged = _partition(params)
    _meet(groups, "fsdp_compose.param_norms")
    inf = math.isinf(p)
    results: list[Optional[torch.Tensor]] = [None] * len(params)
    if groups:
        plan = [(g, g.indices + unmanaged if n == 0 else g.indices)
                for n, g in enumerate(groups)]
    else:
        plan = [(None, unmanaged)]
    unmanaged_set = set(unmanaged)
    for norm_group, indices in plan:
        if not indices:
            continue
        device = norm_group.group.device if norm_group is not None \
            else _first_device(tensors, indices)
        acc = _acc_dtype(device)
        m = len(indices)
        # rows: value, present?, nan? (inf-norm only)
        vec = torch.zeros(3 if inf else 2, m, dtype=acc, device=device)
        contributes = [j for j, i in enumerate(indices)
                       if tensors[i] is not None
                       and not (not inf and norm_group is not None
                                and not norm_group.counts_replicated and i in unmanaged_set)]
        present = [j for j in contributes if tensors[indices[j]].numel()]
        norms = _local_norms([tensors[indices[j]] for j in present], p, foreach)
        if present:
            vals = torch.stack([nv.to(device=device, dtype=acc) for nv in norms])
            pos = torch.tensor(present, device=device)
            if inf:
                nan = vals.isnan()
                vec[0, pos] = torch.where(nan, 0.0, vals)
                vec[2, pos] = nan.to(acc)
            else:
                vec[0, pos] = vals.pow(p)
        if contributes:
            vec[1, torch.tensor(contributes, device=device)] = 1.0
        if norm_group is not None:
            norm_group.all_reduce(vec, dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        values = torch.where(vec[2] > 0, math.nan, vec[0]) if inf else vec[0].pow(1.0 / p)
        values = values.float()
        has = vec[1].tolist() if need_presence else [1.0] * m
        for j, i in enumerate(indices):
            results[i] = values[j] if has[j] > 0 else None
    return results


def _first_device(tensors: list[Optional[torch.Tensor]], indices: list[int]) -> torch.device:
    for i in indices:
        if tensors[i] is not None:
            return tensors[i].device
    return torch.device("cpu")
