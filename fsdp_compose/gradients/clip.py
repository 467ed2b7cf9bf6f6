"""Gradient norms over sharded parameters: clipping and per-parameter norms.

After ``fully_shard`` every original parameter is a view of the part of it
this rank owns (its rows by default, 1-D under ``"flat"``, possibly empty), and its ``.grad`` the matching part of
the averaged gradient. Each element of a sharded parameter is owned by
exactly one rank, so a p-norm over the whole model is

    ||g||_p = (sum over ranks of sum over local shards of |g|^p) ** (1/p)

and the inf-norm is the maximum over ranks of the local maxima. One scalar
all-reduce (SUM, or MAX for the inf-norm) over the sharding process group
therefore gives every rank the norm that ``torch.nn.utils.clip_grad_norm_``
computes on the unsharded model.

Parameters ``fully_shard`` does not manage (``ignored_params``, modules never
annotated) are full-size and replicated: they are counted once, not once per
rank. For p-norms only rank 0 of the (first) process group adds their
``|g|^p``; for the inf-norm every rank adds its local maximum, which is the
same thing when they are replicated. Either way the result is identical on
every rank even if a user forgot to keep ignored parameters' gradients in
sync (it then reflects rank 0's copy, or the largest copy for the inf-norm).

Process groups: parameters are grouped by the process group of their flat
buffer; groups with the same member ranks are merged (e.g. meshes built
separately over the same ranks). There is one all-reduce per distinct group,
in order of first appearance among the given parameters, and the results are
added (max-ed for the inf-norm). With a 1-D mesh over all ranks, the usual
case, that is exactly one all-reduce per call. Every rank of a group must
call with the same parameters (as for any collective); whether a rank has a
gradient locally does not matter (a rank owning no element of a parameter
has ``grad is None`` for it while others do not).

Tensor parallelism: a TP-sharded parameter (a ``DTensor`` with a ``Shard``
placement before ``fully_shard``) holds other elements on every tp rank, so
its ``|g|^p`` is summed over its flat buffer's group and then over the tp
group; TP-replicated ones (``Replicate``) hold the same values on every tp
rank and are summed over the buffer's group only (counted once). That is
one more all-reduce (over tp) per call.

Precision: per-tensor norms are computed in float32 (float64 for float64
tensors), whatever the gradients' dtype (bf16/fp16 included); the sum of
their p-th powers and the all-reduce use float64 (float32 on devices
without float64), so large norms do not overflow. Returned norms are float32.
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


# ------------------------------------------------------------------ public
@torch.no_grad()
def clip_grad_norm_(module_or_params: ParamsArg, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None) -> torch.Tensor:
    """Clip the gradients of (sharded) parameters by their total norm, in place.

    The drop-in for :func:`torch.nn.utils.clip_grad_norm_` on a model
    annotated with ``fully_shard``: the returned total norm is the norm of
    the gradients of all ORIGINAL parameters, as if the model were not
    sharded, and it is identical (bitwise) on every rank. Every gradient is
    multiplied by ``min(max_norm / (total_norm + 1e-6), 1)``.

    Args:
        module_or_params: a module (its ``parameters()``), one tensor, or an
            iterable of parameters; sharded, ignored and plain parameters may
            be mixed. Parameters without ``.grad`` (frozen ones, or a rank
            that owns no element of them) contribute nothing locally.
            A parameter listed twice counts once.
        max_norm: the largest total norm allowed.
        norm_type: ``p > 0`` of the p-norm, or ``inf``.
        error_if_nonfinite: raise ``RuntimeError`` if the total norm is nan
            or inf. The norm is the same on every rank, so either every rank
            raises or none does.
        foreach: use ``torch._foreach_*`` kernels (``None``: where the
            device supports them, like torch).

    Returns:
        The total norm, a float32 0-d tensor on the process group's device
        (the first gradient's device when no parameter is sharded).

    Invariants:
        * ``total_norm`` equals ``torch.nn.utils.clip_grad_norm_`` on the
          unsharded model with the same gradients, up to float rounding;
        * it is the same on every rank, so clipping and ``error_if_nonfinite``
          act the same everywhere;
        * gradients are only scaled down, never up, and never re-allocated.

    Cost:
        one all-reduce of ONE scalar (float64; SUM for p-norms) or of two
        scalars (MAX for the inf-norm: value and a nan flag) per distinct
        process group among the sharded parameters, so one for the usual
        single 1-D mesh; none when no parameter is sharded. No other
        collective and no host sync apart from ``error_if_nonfinite``.
    """
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
    """The total norm of :func:`clip_grad_norm_` without the clipping:
    over every rank, of ``tensors[i]`` (default: ``params[i].grad``), the
    local part of ``params[i]`` (a managed parameter) or a replicated
    tensor (anything else, e.g. ``params[i]`` itself when not managed).
    Parameters are not deduplicated. Collective when any is managed; the
    ranks meet as ``call`` first (ranks in different calls raise)."""
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
    """The full norm of every ORIGINAL parameter (or of its gradient),
    computed from the local shards, e.g. for trust-ratio optimizers
    (LAMB, LARS) or for logging.

    Args:
        module_or_params: a module, or an iterable of parameters (e.g. one
            optimizer param group's ``"params"``).
        kind: ``"grad"`` for the gradients' norms, ``"weight"`` for the
            parameters' own norms.
        norm_type: ``p > 0`` of the p-norm, or ``inf``.
        foreach: as in :func:`clip_grad_norm_`.

    Returns:
        For a module: a dict from the name in ``module.named_parameters()``
        (the original FQN, ``param_info(p).fqn``, when ``module`` is the
        annotated root) to the norm. For an iterable: a list aligned with it.
        Norms are float32 0-d tensors on the process group's device, the
        same on every rank. With ``kind="grad"``, a parameter whose gradient
        is ``None`` on every rank gets ``None``; a rank that owns no element
        of a parameter still gets its full gradient norm.

    Invariants:
        each norm equals ``torch.linalg.vector_norm`` of the unsharded
        parameter (or gradient), up to float rounding; parameters not managed
        by ``fully_shard`` are taken as replicated (rank 0's copy for
        p-norms, the largest copy for the inf-norm, as in
        :func:`clip_grad_norm_`).

    Cost:
        one all-reduce per distinct process group (one for a single mesh) of
        a vector with one entry per parameter of that group (two entries for
        ``kind="grad"``, three for the inf-norm), whatever the number of
        parameters; none when no parameter is sharded. ``kind="grad"`` reads
        the presence flags on the host (one device sync).
    """
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


# ----------------------------------------------------------------- helpers
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
    """Sharded parameters whose norms are summed over the same ranks."""

    group: ShardGroup  # the data-parallel shard group of their flat buffers
    tp_group: Optional[dist.ProcessGroup]  # TP-sharded parameters: also over tp
    indices: list[int]  # positions in the parameter list
    unit: Unit  # the unit of the first of them (whose model says whether to check calls)

    def all_reduce(self, vec: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        _all_reduce(vec, op, self.group)
        if self.tp_group is not None and self.tp_group.size() > 1:
            dist.all_reduce(vec, op=op, group=self.tp_group)
        return vec

    @property
    def counts_replicated(self) -> bool:
        """Whether this rank adds the replicated (unmanaged) parameters'
        ``|g|^p``: one rank of all those the sum runs over."""
        return self.group.rank == 0 and (self.tp_group is None or self.tp_group.rank() == 0)


def _meet(groups: list[_NormGroup], call: str) -> None:
    """Before the first all-reduce of ``call``: every rank of each group
    meets at the store, so a call made on some ranks only raises naming it
    ([Note: call rendezvous]; four store round trips per group)."""
    for norm_group in groups:
        arrive(norm_group.group.process_group, call,
               "Call it on every rank (not under `if rank == 0:`), e.g. right after "
               "backward on every rank, and log its result from rank 0.")


def _group_key(group: ShardGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group.process_group))


def _partition(params: list[torch.Tensor]) -> tuple[list[_NormGroup], list[int]]:
    """Indices of sharded parameters per distinct set of ranks to sum over
    (the process group by member ranks, plus the tp group for TP-sharded
    parameters; in order of first appearance) and of unmanaged parameters.

    Tensor parallelism: a TP-sharded parameter's flat buffer holds this tp
    rank's piece, so its norm is summed over dp and then tp; a TP-replicated
    one (``Replicate`` placement) holds the same values on every tp rank
    and is summed over dp only, so it counts once, not tp-size times."""
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
    return None  # complex tensors: vector_norm returns a real norm by itself


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
    """``||t||_p`` of every tensor (non-empty), as 0-d tensors on its device."""
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
    """``[max ignoring nan, 1 if any nan]`` (gloo's MAX does not propagate nan reliably)."""
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
    if not groups:  # nothing sharded: a plain local norm
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
    """Full norm of each ``tensors[i]`` (the local part of ``params[i]``);
    one all-reduce per distinct process group."""
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
        # rows: value (|t|^p summed, or max), present?, nan? (inf-norm only)
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
