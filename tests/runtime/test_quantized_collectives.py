"""Quantized collectives (``CommPolicy``) on 3 ranks, against one
process on the global batch.

What the quantization promises, and what each test checks:

* forward and backward use the *same* decoded parameters on every rank,
  each within the format's error bound of the exact ones, while the
  sharded master copy stays exact;
* with a quantized all-gather only, the gradient is the exact gradient of
  the global batch at those decoded parameters (fp32 rounding apart);
* with the reduction quantized too, each element of the averaged gradient
  is within ``sum_r bound(max |g_r|) / F`` of that gradient, where ``g_r``
  is rank ``r``'s own gradient over the unit (the largest magnitude of a
  block is at most its unit's): the tolerance is derived from the format,
  not tuned;
* the bytes on the wire are the format's payloads, counted;
* bucketing packs payloads without changing a bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import CommPolicy, MixedPrecisionPolicy, fully_shard, param_info
from fsdp_compose.comm.quantized import FP8_E4M3, BlockQuantizer
from fsdp_compose.runtime.state import state_of
from tests._comm_counter import ALL_GATHER, REDUCE_SCATTER, CollectiveCounter
from tests._training import build_model, local_batch
from tests.harness import run_distributed

WORLD = 3
AG, RS, ALL_TO_ALL = str(ALL_GATHER), str(REDUCE_SCATTER), str(torch.ops.c10d.alltoall_base_.default)
FP8 = FP8_E4M3  # every supported torch has it


def _unit_of(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else ""


def _shard(model, policy: CommPolicy, mp=None, bucket_cap_mb=None, mesh=None,
           reshard_after_forward=None):
    for block in model.blocks:
        fully_shard(block, comm_policy=policy, mp_policy=mp, mesh=mesh,
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, comm_policy=policy, mp_policy=mp, mesh=mesh)
    if bucket_cap_mb is not None:
        model.set_bucket_cap_mb(bucket_cap_mb)
    return model


def _one_step(policy: CommPolicy, mp=None, layout: str = "fsdp") -> dict:
    """Every rank: one forward/backward on its own batch. Returns the
    parameters its forward saw, its pieces of the reduced gradients
    (with where they sit in the flattened parameter) and the master copy.
    ``layout``: ``"fsdp"`` (1-D mesh), ``"hsdp"`` (2 replicas of 2 shards:
    quantized within each shard group, exact across replicas) or
    ``"reshard-to-2"`` (blocks kept over 2 of the 4 ranks after forward:
    backward regathers the decoded values exactly)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) \
        if layout == "hsdp" else None
    model = _shard(build_model(), policy, mp, mesh=mesh,
                   reshard_after_forward=2 if layout == "reshard-to-2" else None)
    seen = {}

    def capture(module, _args):
        prefix = "" if module is model else f"blocks.{list(model.blocks).index(module)}."
        for name, p in module.named_parameters():
            if prefix or not name.startswith("blocks."):
                seen[prefix + name] = p.detach().float().clone()
    for module in [model, *model.blocks]:
        module.register_forward_pre_hook(capture)
    x, y = local_batch(0, rank, world)
    model.loss(x, y).backward()
    pieces = {}
    for name, p in model.named_parameters():
        info = param_info(p)
        pieces[name] = (info.local_offset, p.grad.detach().reshape(-1).clone())
    master = {n: (param_info(p).local_offset, p.detach().reshape(-1).clone())
              for n, p in model.named_parameters()}
    return {"seen": seen, "grads": pieces, "master": master}


def _assemble(results: list[dict], key: str, reference: dict) -> dict:
    """Whole tensors from every rank's pieces (flattened ranges)."""
    out = {}
    for name, like in reference.items():
        full = torch.zeros(like.numel())
        for res in results:
            offset, piece = res[key][name]
            full[offset:offset + piece.numel()] = piece
        out[name] = full.view(like.shape)
    return out


def _per_rank_gradients(weights: dict, world: int) -> list[dict]:
    """One process: each rank's own gradient on its batch at ``weights``."""
    model = build_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    grads = []
    for rank in range(world):
        model.zero_grad()
        x, y = local_batch(0, rank, world)
        model.loss(x, y).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return grads


@pytest.mark.parametrize("code,mp", [(torch.int8, None), (FP8, None),
                                     (torch.int8, torch.bfloat16)])
def test_forward_sees_the_same_decoded_parameters_on_every_rank_within_the_bound(code, mp):
    policy = CommPolicy(all_gather=code, block_size=64)
    mp_policy = MixedPrecisionPolicy(param_dtype=mp) if mp is not None else None
    results = run_distributed(WORLD, _one_step, policy, mp_policy)
    exact = dict(build_model().named_parameters())
    seen = results[0]["seen"]
    assert seen.keys() == exact.keys()
    for res in results[1:]:
        assert all(torch.equal(res["seen"][n], seen[n]) for n in seen)
    quantizer = BlockQuantizer(code, 64)
    units = {_unit_of(n) for n in exact}
    changed = 0
    for unit in units:
        names = [n for n in exact if _unit_of(n) == unit]
        absmax = max(exact[n].detach().abs().max() for n in names)
        bound = float(quantizer.error_bound(absmax)) * (1 + 2 ** -20)
        if mp is not None:  # then rounded to bf16: half an ulp of the decoded value
            bound += float(absmax) * 2 ** -8
        for name in names:
            error = (seen[name] - exact[name].detach()).abs().max().item()
            assert error <= bound, f"{name}: {error} > {bound}"
            changed += not torch.equal(seen[name], exact[name].detach())
    assert changed > len(exact) // 2, "the all-gather was not quantized"
    master = _assemble(results, "master", {n: p.detach() for n, p in exact.items()})
    assert all(torch.equal(master[n], exact[n].detach()) for n in exact), \
        "the sharded master copy must stay exact"


@pytest.mark.parametrize("code", [torch.int8, FP8])
@pytest.mark.parametrize("reduce_quantized", [False, True])
def test_gradient_is_the_global_batch_gradient_at_the_decoded_parameters(code, reduce_quantized):
    _check_gradients(code, reduce_quantized, WORLD, "fsdp")


@pytest.mark.parametrize("layout", ["hsdp", "reshard-to-2"])
def test_hybrid_sharding_and_partial_reshard_keep_the_derived_tolerance(layout):
    _check_gradients(torch.int8, True, 4, layout)


def _check_gradients(code, reduce_quantized: bool, world: int, layout: str) -> None:
    """The reduced gradient against the mean of the ranks' own gradients
    at the decoded parameters: fp32 rounding apart, plus, when the
    reduction is quantized, the bound of every rank's contribution. Under
    hybrid sharding each contribution is quantized once (in its shard
    group) and the replicas' mean is exact, so the bound is the same."""
    policy = CommPolicy(all_gather=code, reduce_scatter=code if reduce_quantized else None,
                        block_size=64)
    results = run_distributed(world, _one_step, policy, None, layout)
    seen = results[0]["seen"]
    per_rank = _per_rank_gradients(seen, world)
    want = {n: sum(g[n] for g in per_rank) / world for n in seen}
    got = _assemble(results, "grads", want)
    quantizer = BlockQuantizer(code, 64)
    worst = 0.0
    for unit in {_unit_of(n) for n in seen}:
        names = [n for n in seen if _unit_of(n) == unit]
        tolerance = 1e-6 * max(float(want[n].abs().max()) for n in names) + 1e-9
        if reduce_quantized:
            tolerance += sum(float(quantizer.error_bound(max(g[n].abs().max() for n in names)))
                             for g in per_rank) / world * (1 + 2 ** -20)
        for name in names:
            error = (got[name] - want[name]).abs().max().item()
            assert error <= tolerance, f"{name}: {error} > {tolerance}"
            worst = max(worst, error)
    if reduce_quantized:
        assert worst > 1e-6, "the reduction was not quantized"


def _bytes_of_a_step(policy: CommPolicy, bucket_cap_mb: float) -> dict:
    """Every rank: the collectives of the third step (the first one
    bucketed) and the parameters after it (SGD)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _shard(build_model(), policy, bucket_cap_mb=bucket_cap_mb)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = local_batch(step, rank, world)
        if step == 2:
            with CollectiveCounter() as counter:
                model.loss(x, y).backward()
        else:
            model.loss(x, y).backward()
        optim.step()
        optim.zero_grad()
    blocks = [b.layout.shard_numel for blk in model.blocks for b in state_of(blk).unit.buffers]
    root = [b.layout.shard_numel for b in state_of(model).unit.buffers]
    return {"counts": {str(op): n for op, n in counter.counts.items()},
            "bytes": {str(op): n for op, n in counter.bytes.items()},
            "blocks": blocks, "root": root,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def test_bytes_on_the_wire_are_the_payloads_and_bucketing_changes_no_bit():
    exact = run_distributed(WORLD, _bytes_of_a_step, CommPolicy(), 0)[0]
    policy = CommPolicy(all_gather=torch.int8, reduce_scatter=torch.int8)
    alone = run_distributed(WORLD, _bytes_of_a_step, policy, 0)
    bucketed = run_distributed(WORLD, _bytes_of_a_step, policy, 25)
    q = BlockQuantizer(torch.int8, 256)
    blocks, root = exact["blocks"], exact["root"]
    # each block is gathered in forward and in backward, the root once (kept for backward)
    assert exact["bytes"][AG] == WORLD * 4 * (2 * sum(blocks) + sum(root))
    assert exact["bytes"][RS] == 4 * (sum(blocks) + sum(root))
    for res in alone + bucketed:
        assert res["bytes"][AG] == WORLD * (
            2 * sum(q.payload_bytes(s) for s in blocks) + sum(q.payload_bytes(s) for s in root))
        assert res["bytes"][ALL_TO_ALL] == WORLD * sum(q.payload_bytes(s) for s in blocks + root)
        assert RS not in res["counts"]
    ratio = alone[0]["bytes"][AG] / exact["bytes"][AG]
    assert ratio < 0.28  # ~1/4 (int8 vs fp32) plus scales and the last blocks' padding
    assert alone[0]["counts"][AG] == 2 * len(blocks) + len(root)
    assert bucketed[0]["counts"][AG] < alone[0]["counts"][AG]
    assert bucketed[0]["counts"][ALL_TO_ALL] < alone[0]["counts"][ALL_TO_ALL]
    for a, b in zip(alone, bucketed):
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


def _seen_over_a_mesh_of_one_shard() -> dict:
    """Pure replication (mesh ``(2, 1)``), bf16 compute: shard groups of one
    rank, which move nothing."""
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = _shard(build_model(), CommPolicy(all_gather=torch.int8, reduce_scatter=torch.int8),
                   MixedPrecisionPolicy(param_dtype=torch.bfloat16), mesh=mesh)
    seen = {}
    model.blocks[0].register_forward_pre_hook(
        lambda m, _: seen.update({n: p.detach().clone() for n, p in m.named_parameters()}))
    model.loss(*local_batch(0, dist.get_rank(), 2)).backward()
    return seen


def test_one_rank_shard_groups_are_not_quantized():
    exact = dict(build_model().blocks[0].named_parameters())
    for seen in run_distributed(2, _seen_over_a_mesh_of_one_shard):
        for name, value in seen.items():
            assert torch.equal(value, exact[name].detach().to(torch.bfloat16)), name
