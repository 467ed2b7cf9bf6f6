"""torch's ``MixedPrecisionPolicy`` means here what it means under the
installed torch's ``fully_shard``: ``reduce_dtype=None`` reduces in the
parameter's dtype from torch 2.15 on and in ``param_dtype`` before, and
``param_dtype_override_fn`` keeps the parameters it names in their own
dtype (checked against torch's own ``fully_shard`` on the same torch).
``make test-newest`` runs this file on 2.15, ``make test`` and
``make test-oldest`` before it.

Run: ``PYTHONPATH=. python -m pytest -q tests/core/test_torch_mixed_precision.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.torch_version import TorchVersion

from fsdp_compose import MixedPrecisionPolicy, fully_shard
from fsdp_compose.buffers.records import buffer_policy, resolve_dtypes
from fsdp_compose.runtime.state import states_below
from tests._comm_counter import REDUCE_SCATTER, CollectiveCounter
from tests.harness import run_distributed

BF16, FP32 = torch.bfloat16, torch.float32
TORCH_215 = TorchVersion(torch.__version__) >= (2, 15)
HAS_OVERRIDE = "param_dtype_override_fn" in {
    f.name for f in dataclasses.fields(torch_fsdp.MixedPrecisionPolicy)}


class Net(nn.Module):
    """Uneven widths; a LayerNorm between two linears (the usual fp32 keep)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 15)
        self.norm = nn.LayerNorm(15)
        self.fc2 = nn.Linear(15, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(torch.tanh(self.fc1(x))))


_NORMS: set[int] = set()
"""ids of the norm's parameters of the last :func:`_build` (in this process)."""


def _keep_norms(param: nn.Parameter):
    return param.dtype if id(param) in _NORMS else None


def _build() -> Net:
    torch.manual_seed(7)
    net = Net()
    _NORMS.clear()
    _NORMS.update(id(p) for p in net.norm.parameters())
    return net


def _policy(which: str, override: bool):
    kwargs = {"param_dtype_override_fn": _keep_norms} if override else {}
    if which == "torch":
        return torch_fsdp.MixedPrecisionPolicy(param_dtype=BF16, **kwargs)
    return MixedPrecisionPolicy(param_dtype=BF16, **kwargs)


def _run(impl: str, which: str, override: bool) -> dict:
    """Every rank: ``impl``'s ``fully_shard`` (``ours`` or ``torch``) with
    ``which`` policy; the dtypes each module's weight has inside forward
    and the dtypes the backward's reduce-scatters move."""
    shard = fully_shard if impl == "ours" else torch_fsdp.fully_shard
    net = _build()
    shard(net, mp_policy=_policy(which, override))
    seen: dict[str, str] = {}
    for name in ("fc1", "norm", "fc2"):
        def record(module: nn.Module, args: tuple, name: str = name) -> None:
            seen.setdefault(name, str(module.weight.dtype))
        getattr(net, name).register_forward_pre_hook(record)
    rank = dist.get_rank()
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
    with CollectiveCounter() as counter:
        net(x).float().pow(2).mean().backward()
    out = {"forward": seen,
           "reduce_dtypes": sorted(str(d) for d in counter.dtypes.get(REDUCE_SCATTER, set()))}
    if impl == "ours":
        out["buffers"] = sorted((str(b.compute_dtype), str(b.reduce_dtype))
                                for s in states_below((net,)) for b in s.unit.buffers)
    return out


def test_torch_policy_reduces_in_the_dtype_the_installed_torch_uses():
    """``torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=bf16)``:
    fp32 reduce-scatters on torch >= 2.15, bf16 before, as torch's own
    ``fully_shard`` on the same torch (2 ranks, fp32 parameters)."""
    ours = run_distributed(2, _run, "ours", "torch", False, timeout=120)
    theirs = run_distributed(2, _run, "torch", "torch", False, timeout=120)
    want = "torch.float32" if TORCH_215 else "torch.bfloat16"
    for mine, fsdp2 in zip(ours, theirs):
        assert mine["reduce_dtypes"] == fsdp2["reduce_dtypes"] == [want]
        assert {reduce for _, reduce in mine["buffers"]} == {want}


def test_own_policy_keeps_its_meaning_on_every_torch():
    """fsdp_compose's ``MixedPrecisionPolicy(param_dtype=bf16)`` reduces in
    bf16 whatever the torch; ``reduce_follows_grad_dtype=True`` is torch
    2.15's meaning (fp32 here)."""
    ours = run_distributed(2, _run, "ours", "ours", False, timeout=120)
    for res in ours:
        assert res["reduce_dtypes"] == ["torch.bfloat16"]
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_follows_grad_dtype=True)
    dtypes = resolve_dtypes(FP32, buffer_policy(policy, None, False))
    assert (dtypes.compute, dtypes.reduce) == (BF16, FP32)


@pytest.mark.parametrize("which", ["ours"] + (["torch"] if HAS_OVERRIDE else []))
def test_param_dtype_override_fn_keeps_chosen_parameters_in_their_dtype(which):
    """The norm's parameters, kept by ``param_dtype_override_fn``, are fp32
    inside forward, the linears bf16; on a torch whose policy has the
    field, torch's own ``fully_shard`` does the same."""
    ours = run_distributed(2, _run, "ours", which, True, timeout=120)
    for res in ours:
        assert res["forward"] == {"fc1": "torch.bfloat16", "norm": "torch.float32",
                                  "fc2": "torch.bfloat16"}
        assert ("torch.float32", "torch.float32") in res["buffers"]
    if which == "torch":
        for res in run_distributed(2, _run, "torch", "torch", True, timeout=120):
            assert res["forward"] == ours[0]["forward"]


def _bad_override() -> str:
    net = _build()
    policy = MixedPrecisionPolicy(param_dtype=BF16,
                                  param_dtype_override_fn=lambda p: torch.float16)
    try:
        fully_shard(net, mp_policy=policy)
    except ValueError as e:
        return str(e)
    return "no error"


def test_param_dtype_override_fn_refuses_other_dtypes_on_every_rank():
    """A dtype other than ``None``, ``param_dtype`` or the parameter's own
    raises ``ValueError`` naming the parameter, on every rank (as torch)."""
    for message in run_distributed(2, _bad_override, timeout=60):
        assert "'fc1.weight'" in message and "torch.float16" in message
