"""Mixed precision and CPU offload on units with tensor-parallel parameters,
on the 2-D (dp 2 x tp 2) mesh and the 3-D (dp_replicate 2 x dp_shard 1 x
tp 2) HSDP x TP mesh.

Mixed precision (bf16 compute, fp32 reduce) is compared with the same
recipe in one process: every step the fp32 master weights are cast to bf16,
each dp rank's slice of the global batch runs separately, the bf16
gradients are averaged in fp32 and the fp32 master weights step. TP splits
the bf16 matmuls (a Rowwise layer sums bf16 partial products across tp
ranks), so the results round differently: parameters within 1e-2, the bf16
losses within one bf16 ulp (2**-7 relative). SGD-momentum only: AdamW
normalises each update, so an element whose gradient is bf16 rounding noise
moves by up to lr per step either way (measured: the fp32 run is as far from
the bf16 reference as the bf16 run, 2e-2 after three steps). That the run
really computes in bf16 is checked directly: the TP parameters forward sees
are bf16 DTensors, the all-gathers and TP's all-reduces move bf16.
Offload changes where the shards live, not the arithmetic: exact (AdamW).

Run: PYTHONPATH=. python -m pytest -q tests/parallelism/test_tp_precision.py
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from torch.distributed.tensor.parallel import parallelize_module

from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from tests.harness import run_distributed
from tests.parallelism.test_hsdp_tp import dp_slice, mesh_3d, shard_3d
from tests.parallelism.test_tensor_parallel import PLAN, _local, build_model, global_batch, make_optimizer
from tests._comm_counter import ALL_GATHER, CollectiveCounter
from tests._owners import buffer_of

BF16, FP32 = torch.bfloat16, torch.float32
STEPS = 3
MESHES = {"2d": (2, 2), "3d": (2, 1, 2)}


def _train(mesh_name: str, optim_name: str, mixed: bool, offload: bool):
    shape = MESHES[mesh_name]
    kwargs = {}
    if mixed:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    model = build_model()
    if len(shape) == 2:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        for block in model.blocks:  # shard_2d, with the policies on the root too
            parallelize_module(block, mesh["tp"], PLAN)
            fully_shard(block, mesh=mesh["dp"], **kwargs)
        fully_shard(model, mesh=mesh["dp"], **kwargs)
        local, dp = (lambda t: _local(t, mesh)), mesh["dp"].size()
    else:
        mesh = mesh_3d(shape)
        shard_3d(model, mesh, **kwargs)
        local, dp = (lambda t: dp_slice(t, mesh)), shape[0] * shape[1]
    optim = make_optimizer(model, optim_name)
    losses, seen = [], {}

    def probe(module, args):
        seen["weight"] = (type(module.weight).__name__, str(module.weight.dtype))

    model.blocks[0].q.register_forward_pre_hook(probe)
    counter = _DtypeCounter()
    for step in range(STEPS):
        x, y = global_batch(step, dp)
        with counter if step == STEPS - 1 else _null():
            loss = model.loss(local(x), local(y))
            loss.backward()
        optim.step()
        optim.zero_grad()
        loss = loss.detach().float()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    dtypes = {str(p.dtype) for p in model.parameters()}
    devices = {str(buffer_of(p).sharded.device) for p in model.parameters()}
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": full, "dtypes": dtypes, "devices": devices,
            "forward_weight": seen["weight"],
            "ag_dtypes": {str(d) for d in counter.dtypes.get(ALL_GATHER, ())},
            "tp_dtypes": {str(d) for d in counter.tp_dtypes}}


class _DtypeCounter(CollectiveCounter):
    """Also records the dtypes of TP's functional all-reduces."""

    def __init__(self) -> None:
        super().__init__()
        self.tp_dtypes: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and "all_reduce" in str(func):
            self.tp_dtypes.add(args[0].dtype)
        return super().__torch_dispatch__(func, types, args, kwargs)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def reference_bf16(optim_name: str, dp: int):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        master = build_model()
        optim = make_optimizer(master, optim_name)
        losses = []
        for step in range(STEPS):
            x, y = global_batch(step, dp)
            low = copy.deepcopy(master).to(BF16)
            grads = [torch.zeros_like(p) for p in master.parameters()]
            step_loss = 0.0
            for xs, ys in zip(x.chunk(dp), y.chunk(dp)):
                low.zero_grad()
                loss = low.loss(xs, ys)
                loss.backward()
                step_loss += loss.float().item() / dp
                for g, p in zip(grads, low.parameters()):
                    g += p.grad.float()
            for g, p in zip(grads, master.parameters()):
                p.grad = g / dp
            optim.step()
            optim.zero_grad()
            losses.append(step_loss)
        return {"losses": losses,
                "params": {k: v.detach().clone() for k, v in master.state_dict().items()}}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mesh_name", ["2d", "3d"])
def test_bf16_parity_with_the_same_recipe_in_one_process(mesh_name):
    shape = MESHES[mesh_name]
    results = run_distributed(4, _train, mesh_name, "sgd", True, False, timeout=120)
    dp = shape[0] if len(shape) == 2 else shape[0] * shape[1]
    reference = reference_bf16("sgd", dp)
    for res in results:
        assert res["dtypes"] == {"torch.float32"}  # the master weights stay fp32
        assert res["forward_weight"] == ("DTensor", "torch.bfloat16"), res["forward_weight"]
        assert res["tp_dtypes"] == {"torch.bfloat16"}, res["tp_dtypes"]
        if shape[-2] > 1:  # dp_shard of the 3-D (2, 1, 2) mesh has one rank: no all-gather
            assert res["ag_dtypes"] == {"torch.bfloat16"}, res["ag_dtypes"]
        for got, want in zip(res["losses"], reference["losses"]):
            assert abs(got - want) <= 2 ** -7 * abs(want), (got, want)
        for name, want in reference["params"].items():
            diff = (res["params"][name] - want).abs().max().item()
            assert diff <= 1e-2, f"{name} differs by {diff}"


@pytest.mark.parametrize("mesh_name", [pytest.param("2d", marks=pytest.mark.slow), "3d"])
def test_offload_is_exact(mesh_name):
    """The same run with and without offload (bf16 compute: the gathered
    copy is cast from the CPU shard) gives bit-identical losses and
    parameters; the shards live on the CPU."""
    offloaded = run_distributed(4, _train, mesh_name, "adamw", True, True, timeout=120)
    plain = run_distributed(4, _train, mesh_name, "adamw", True, False, timeout=120)
    for a, b in zip(offloaded, plain):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
        assert a["devices"] == {"cpu"}
