"""Mixed precision and CPU offload.

The reference applies the same precision recipe in one process: every step
it casts the fp32 master weights to the low dtype, runs each rank's local
batch separately (as the ranks do), averages the low-precision gradients in
the reduce dtype, and steps the fp32 master weights. Tolerances:
reduce in fp32 -> 1e-5 on parameters (same kernels, one thread, so the bf16
compute is bit-identical and only the fp32 averaging order differs);
reduce in bf16 -> 1e-2 (bf16 has 8 bits of mantissa; the collective and the
reference may round the sum in a different order).
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist

from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from tests._owners import buffer_of
from tests._comm_counter import ALL_GATHER, REDUCE_SCATTER, CollectiveCounter
from tests._training import build_model, gather_master_params, global_batch, make_optimizer
from tests.harness import TEST_DEVICE, run_distributed

BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16
STEPS = 3


def _policies(recipe, low, reduce, comm=None):
    """(policy for blocks, policy for root) of a recipe."""
    if recipe == "uniform":
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce,
                                      reduce_comm_dtype=comm)
        return policy, policy
    # "fp32-root": blocks in low precision, the root (embeddings, final
    # norm, head) in fp32; blocks take and give fp32 activations.
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce, reduce_comm_dtype=comm,
                                output_dtype=FP32), None


def train_mixed(recipe, low, reduce, offload, optim_name, comm_dtype=None, micro=1):
    """``micro`` > 1: each rank's batch in ``micro`` micro-batches, all but
    the last without gradient sync (counted: the last one's collectives)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    block_policy, root_policy = _policies(recipe, low, reduce, comm_dtype)
    offload_policy = CPUOffloadPolicy() if offload else None
    for block in model.blocks:
        fully_shard(block, mp_policy=block_policy, offload_policy=offload_policy)
    fully_shard(model, mp_policy=root_policy, offload_policy=offload_policy)
    optim = make_optimizer(model, optim_name)
    losses, comm, accumulators = [], None, set()
    for step in range(STEPS):
        x, y = global_batch(step, world, "plain")
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        step_loss = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            last = i == micro - 1
            model.set_requires_gradient_sync(last)
            with CollectiveCounter() as counter:
                loss = model.loss(xm, ym) / micro
                loss.backward()
            if not last:  # the no-sync sum of micro-batches
                accumulators |= {str(buffer_of(p).grad._accumulated.dtype)
                                 for p in model.parameters()
                                 if buffer_of(p).grad._accumulated is not None}
            step_loss += loss.detach().float().item()
        comm = counter
        optim.step()
        optim.zero_grad()
        loss = torch.tensor(step_loss)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    placement = {str(p.device) for p in model.parameters()} | {
        str(s.device) for st in optim.state.values() for s in st.values() if torch.is_tensor(s)}
    dtypes = {str(p.dtype) for p in model.parameters()} | {
        str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
    full = gather_master_params(model)
    return {"losses": losses, "params": full, "placement": placement, "dtypes": dtypes,
            "accumulators": accumulators,
            "ag_dtypes": {str(d) for d in comm.dtypes.get(ALL_GATHER, ())},
            "rs_dtypes": {str(d) for d in comm.dtypes.get(REDUCE_SCATTER, ())},
            "ag_bytes": comm.bytes[ALL_GATHER], "rs_bytes": comm.bytes[REDUCE_SCATTER]}


def _low_precision_copy(master, recipe, low):
    model = copy.deepcopy(master)
    if recipe == "uniform":
        return model.to(low)
    for block in model.blocks:
        block.to(low)
        block.register_forward_pre_hook(lambda m, args: tuple(a.to(low) for a in args))
        block.register_forward_hook(lambda m, args, out: out.to(FP32))
    return model


def reference_mixed(world, recipe, low, reduce, optim_name):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks compute with one thread: same kernels
    try:
        master = build_model()
        optim = make_optimizer(master, optim_name)
        losses = []
        for step in range(STEPS):
            x, y = global_batch(step, world, "plain")
            per = x.shape[0] // world
            model = _low_precision_copy(master, recipe, low)
            grads = [torch.zeros_like(p) for p in master.parameters()]
            step_loss = 0.0
            for r in range(world):
                model.zero_grad()
                loss = model.loss(x[r * per:(r + 1) * per], y[r * per:(r + 1) * per])
                loss.backward()
                step_loss += loss.float().item() / world
                for g, p in zip(grads, model.parameters()):
                    g += p.grad.to(reduce or p.grad.dtype).float()
            for g, p in zip(grads, master.parameters()):
                p.grad = g / world
            optim.step()
            optim.zero_grad()
            losses.append(step_loss)
        return {"losses": losses,
                "params": {n: p.detach().cpu().clone() for n, p in master.named_parameters()}}
    finally:
        torch.set_num_threads(threads)


def _compare(results, reference, atol, loss_atol):
    worst = 0.0
    for res in results:
        for got, want in zip(res["losses"], reference["losses"]):
            assert abs(got - want) <= loss_atol, (got, want)
        for name, want in reference["params"].items():
            diff = (res["params"][name] - want).abs().max().item()
            worst = max(worst, diff)
            assert diff <= atol, f"{name} differs by {diff}"
    return worst


@pytest.mark.parametrize("recipe", ["uniform", "fp32-root"])
@pytest.mark.parametrize("world", [2, 3])
def test_bf16_compute_fp32_reduce_parity(recipe, world):
    results = run_distributed(world, train_mixed, recipe, BF16, FP32, False, "sgd")
    reference = reference_mixed(world, recipe, BF16, FP32, "sgd")
    _compare(results, reference, atol=1e-5, loss_atol=1e-5)
    for res in results:
        assert res["ag_dtypes"] == ({"torch.bfloat16"} if recipe == "uniform"
                                    else {"torch.bfloat16", "torch.float32"})
        assert res["rs_dtypes"] == {"torch.float32"}
        assert res["dtypes"] == {"torch.float32"}  # master weights and grads stay fp32


@functools.cache
def _fp32_adamw(world: int) -> list[dict]:
    """The fp32 AdamW run (no policy, no offload) the bytes and offload tests
    compare with: run once per world size, only read."""
    return run_distributed(world, train_mixed, "uniform", FP32, None, False, "adamw")


def test_bf16_reduce_parity_and_halved_bytes():
    results = run_distributed(2, train_mixed, "uniform", BF16, None, False, "adamw")
    reference = reference_mixed(2, "uniform", BF16, BF16, "adamw")
    _compare(results, reference, atol=1e-2, loss_atol=1e-2)
    full = _fp32_adamw(2)
    for low, high in zip(results, full):
        assert low["ag_dtypes"] == {"torch.bfloat16"} and low["rs_dtypes"] == {"torch.bfloat16"}
        assert low["ag_bytes"] * 2 == high["ag_bytes"]
        assert low["rs_bytes"] * 2 == high["rs_bytes"]


@pytest.mark.parametrize("micro", [1, 2])
def test_bf16_comm_with_fp32_accumulation(micro):
    """``reduce_comm_dtype=bf16`` under ``reduce_dtype=fp32``: the collective
    moves bf16 (half the bytes), no-sync micro-batches are summed in fp32,
    and the result is within bf16 tolerance of the fp32-reduced reference."""
    results = run_distributed(2, train_mixed, "uniform", BF16, FP32, False, "adamw", BF16, micro)
    wide = run_distributed(2, train_mixed, "uniform", BF16, FP32, False, "adamw", None, micro)
    if micro == 1:
        _compare(results, reference_mixed(2, "uniform", BF16, FP32, "adamw"), atol=1e-2,
                 loss_atol=1e-2)
    else:  # the reference has no micro-batches (bf16 compute on half batches rounds differently)
        _compare(results, wide[0], atol=1e-2, loss_atol=1e-2)
    for low, high in zip(results, wide):
        assert low["rs_dtypes"] == {"torch.bfloat16"} and high["rs_dtypes"] == {"torch.float32"}
        assert low["rs_bytes"] * 2 == high["rs_bytes"]
        assert low["dtypes"] == {"torch.float32"}  # master weights and grads stay fp32
        assert low["accumulators"] == (set() if micro == 1 else {"torch.float32"})


def test_fp16_compute_parity():
    results = run_distributed(2, train_mixed, "uniform", FP16, FP32, False, "sgd")
    reference = reference_mixed(2, "uniform", FP16, FP32, "sgd")
    _compare(results, reference, atol=1e-5, loss_atol=1e-4)


@pytest.mark.parametrize("world", [1, 2])
def test_cpu_offload_is_exact_and_keeps_state_on_cpu(world):
    offloaded = run_distributed(world, train_mixed, "uniform", FP32, None, True, "adamw")
    plain = _fp32_adamw(world)
    # exact on the CPU; on a GPU the offloaded parameters step on the CPU and
    # the others on the GPU (AdamW's arithmetic rounds differently there)
    atol = 0.0 if TEST_DEVICE.type == "cpu" else 1e-6
    for a, b in zip(offloaded, plain):
        assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) <= atol
        assert all(torch.allclose(a["params"][n], b["params"][n], rtol=0, atol=atol)
                   for n in a["params"])
        assert a["placement"] == {"cpu"}


def buffer_dtype_and_output_dtype():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=BF16, output_dtype=FP16,
                                                     buffer_dtype=BF16))
    buffers = buffer_of(model[0].weight)
    out = model(torch.randn(3, 4))
    return (out.dtype, model[1].running_mean.dtype, buffers.compute_dtype, buffers.dtype)


def test_buffer_and_output_dtypes():
    out, running, compute, master = run_distributed(1, buffer_dtype_and_output_dtype)[0]
    assert (out, running, compute, master) == (FP16, BF16, BF16, FP32)


def test_policy_validation():
    with pytest.raises(ValueError, match="param_dtype"):
        MixedPrecisionPolicy(param_dtype=torch.int32)
    with pytest.raises(ValueError, match="reduce_comm_dtype"):
        MixedPrecisionPolicy(reduce_comm_dtype=torch.int8)
