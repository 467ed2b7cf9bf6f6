"""The FSDP2 module API that annotated modules gain, checked numerically
against a single-process reference on the global batch and by counting
collectives (``tests/_comm_counter.py``).

Numbering follows the issue: 10 ``reshard_after_forward`` default, 11 world
size 1, 12 ``set_gradient_divide_factor`` / ``set_force_sum_reduction_for_comms``,
13 ``set_is_last_backward``, 14 ``set_unshard_in_backward``, 15 the root's
``clip_grad_norm_`` method.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from fsdp_compose import fully_shard
from tests._comm_counter import ALL_GATHER, REDUCE_SCATTER, CollectiveCounter
from tests._models import (D, PER_RANK, VOCAB, assemble_grads, assert_dicts_close, assert_parity,
                           build_lm, full_params, grad_pieces, lm_loss, make_optim, plain_params,
                           rank_slice, rank_world, shard_blocks_and_root, token_batch)
from tests.harness import run_distributed

TIMEOUT = 60
N_BLOCKS = 2  # blocks + root: N = 3 units


def reference_lm(world: int, steps: int, seed: int, optim_name: str = "sgd",
                 per_rank: int = PER_RANK, scale: float = 1.0, max_norm: float | None = None):
    """One process on the global batch: loss = ``scale`` x the mean loss;
    optionally ``torch.nn.utils.clip_grad_norm_`` before each step. Returns
    the final parameters, the gradients after each backward and the norms."""
    model = build_lm(N_BLOCKS)
    optim = make_optim(model.parameters(), optim_name)
    grads, norms = [], []
    for step in range(steps):
        tokens, targets = token_batch(step, world * per_rank, seed=seed)
        (scale * model.loss(tokens, targets)).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, 2.0)))
        optim.step()
        optim.zero_grad()
    return {"params": plain_params(model), "grads": grads, "norms": norms}


def _sharded_lm(optim_name: str) -> tuple:
    """TinyLM (seeded) with every block and the root annotated, and its optimizer."""
    model = shard_blocks_and_root(build_lm(N_BLOCKS))
    return model, make_optim(model.parameters(), optim_name)


def _local_batch(step: int, seed: int, per_rank: int = PER_RANK):
    rank, world = rank_world()
    tokens, targets = token_batch(step, world * per_rank, seed=seed)
    return rank_slice(tokens, rank, world), rank_slice(targets, rank, world)


def _counts(counter) -> dict:
    return {"all_gathers": counter.counts.get(ALL_GATHER, 0),
            "reduce_scatters": counter.counts.get(REDUCE_SCATTER, 0),
            "total": sum(counter.counts.values()),
            "ops": sorted(str(op) for op in counter.counts)}


# ============================================================================
# 10. reshard_after_forward: default leaves the root unsharded; True reshards it
# ============================================================================
SEED_10 = 10


def train_counting_root(root_kw: dict, steps: int = 3):
    """Blocks annotated with no argument, the root with ``root_kw``. Counts
    the collectives of step 2's (steady-state) forward+backward and records whether the
    root's ``lm_head.weight`` is unsharded between forward and backward."""
    model = build_lm(N_BLOCKS)
    shard_blocks_and_root(model, **root_kw)
    model.set_bucket_cap_mb(0)  # the per-unit structure (tests/runtime/test_bucketing.py counts buckets)
    optim = make_optim(model.parameters(), "sgd")
    counts, root_shapes = None, []
    for step in range(steps):
        tokens, targets = _local_batch(step, SEED_10)
        counter = CollectiveCounter() if step == 2 else contextlib.nullcontext()
        with counter:
            logits = model(tokens)
            root_shapes.append(tuple(model.lm_head.weight.shape))
            lm_loss(logits, targets).backward()
        if step == 2:  # steady state: steps 0 and 1 also verify the collective order
            counts = _counts(counter)
        optim.step()
        optim.zero_grad()
    return {"params": full_params(model), "counts": counts, "root_shapes": root_shapes,
            "local_shape": tuple(model.lm_head.weight.shape)}  # this rank's piece


def test_reshard_after_forward_default_keeps_root_unsharded_and_true_reshards_it():
    """Blocks annotated with no argument. Root with no argument: unsharded
    from forward to backward, 2N-1 all-gathers per step for N units. Root
    with ``reshard_after_forward=True``: resharded after forward and
    gathered again for backward, 2N all-gathers. Parity in both."""
    n = N_BLOCKS + 1
    reference = reference_lm(2, 3, SEED_10)
    default = run_distributed(2, train_counting_root, {}, timeout=TIMEOUT)
    for rank, res in enumerate(default):
        assert res["counts"]["all_gathers"] == 2 * n - 1, (rank, res["counts"])
        assert all(shape == (VOCAB, D) for shape in res["root_shapes"]), (
            f"rank {rank}: the root was resharded after forward by default: {res['root_shapes']}")
    assert_parity(default, reference)
    resharded = run_distributed(2, train_counting_root, {"reshard_after_forward": True},
                                timeout=TIMEOUT)
    for rank, res in enumerate(resharded):
        # this rank's piece, as between iterations: (rows_here, D) under the default
        # placement, which is (VOCAB, D) on a rank holding all rows (checked below)
        assert all(shape == res["local_shape"] for shape in res["root_shapes"]), (
            f"rank {rank}: reshard_after_forward=True on the root left it unsharded after "
            f"forward (lm_head.weight shapes {res['root_shapes']})")
        assert res["counts"]["all_gathers"] == 2 * n, (
            f"rank {rank}: expected {2 * n} all-gathers (every unit, root included, gathered "
            f"again for backward), got {res['counts']}")
    assert any(res["local_shape"] != (VOCAB, D) for res in resharded)  # some rank tells
    assert_parity(resharded, reference)


def annotate_with_int_reshard(value: int):
    model = build_lm(N_BLOCKS)
    try:
        fully_shard(model, reshard_after_forward=value)
    except (NotImplementedError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("value", [3, 0])
def test_reshard_after_forward_integer_not_dividing_the_shard_size_raises(value):
    """Integers are FSDP2's smaller post-forward groups (tests/parallelism/test_hsdp.py);
    one that does not divide the shard group size raises on every rank."""
    for rank, res in enumerate(run_distributed(2, annotate_with_int_reshard, value,
                                               timeout=TIMEOUT)):
        assert res is not None, (
            f"rank {rank}: fully_shard(model, reshard_after_forward={value}) was accepted")
        assert res[0] == "ValueError" and "must divide the shard group size 2" in res[1], res


# ============================================================================
# 11. World size 1: no collectives at all
# ============================================================================
SEED_11 = 11


def train_world_one(steps: int = 3):
    """Counts every c10d op of every step (forward with the root's lazy
    initialisation, backward, optimizer step, zero_grad)."""
    model, optim = _sharded_lm("sgd")
    counter = CollectiveCounter()
    for step in range(steps):
        tokens, targets = _local_batch(step, SEED_11)
        with counter:
            model.loss(tokens, targets).backward()
            optim.step()
            optim.zero_grad()
    return {"params": full_params(model), "counts": _counts(counter)}


def test_world_size_one_runs_no_collectives():
    [res] = run_distributed(1, train_world_one, timeout=TIMEOUT)
    assert res["counts"]["total"] == 0, (
        f"a world of one rank ran collectives during training steps: {res['counts']}")
    assert_parity([res], reference_lm(1, 3, SEED_11))


def blocks_between_forward_and_backward(steps: int = 3):
    """Per step: whether block 0's ``fc1.weight`` is an ``nn.Parameter``
    between forward and backward and after backward, how many times the
    module attributes were swapped to the unsharded views, and how many
    times the collective queue was asked to gather."""
    from fsdp_compose.buffers.param_views import ParamSlots
    from fsdp_compose.runtime.collective_queue import CollectiveQueue
    swaps = gathers = 0
    swap_in_views, gather = ParamSlots.swap_in_views, CollectiveQueue.gather

    def counted_swap(slots):
        nonlocal swaps
        swaps += 1
        swap_in_views(slots)

    def counted_gather(queue, *args):
        nonlocal gathers
        gathers += 1
        gather(queue, *args)

    ParamSlots.swap_in_views, CollectiveQueue.gather = counted_swap, counted_gather
    try:
        model, optim = _sharded_lm("sgd")
        seen = []
        for step in range(steps):
            tokens, targets = _local_batch(step, SEED_11)
            swaps = gathers = 0
            loss = model.loss(tokens, targets)
            between = type(model.blocks[0].fc1.weight) is torch.nn.Parameter
            loss.backward()
            after = type(model.blocks[0].fc1.weight) is torch.nn.Parameter
            seen.append((between, after, swaps, gathers))
            optim.step()
            optim.zero_grad()
    finally:
        ParamSlots.swap_in_views, CollectiveQueue.gather = swap_in_views, gather
    return {"seen": seen, "params": full_params(model)}


def test_one_rank_keeps_the_views_from_forward_to_backward():
    """Over one rank the unsharded buffer is the shard: resharding after
    forward would free nothing and backward would only swap the views back
    in. So a block keeps its views until its post-backward reshard (one
    swap per unit and step) and the collective queue is never asked to
    gather (the local path, [Note: the local path]), while over two ranks
    it is resharded after forward and gathered and swapped again in
    backward. Parity in both."""
    n = N_BLOCKS + 1
    [one] = run_distributed(1, blocks_between_forward_and_backward, timeout=TIMEOUT)
    assert one["seen"] == [(False, True, n, 0)] * 3, (
        "over one rank, expected block 0 unsharded (a view) from forward to backward, its "
        f"Parameter back after backward, {n} swaps and no gather per step; got (between, "
        f"after, swaps, gathers) per step = {one['seen']}")
    assert_parity([one], reference_lm(1, 3, SEED_11))
    two = run_distributed(2, blocks_between_forward_and_backward, timeout=TIMEOUT)
    for rank, res in enumerate(two):
        # the root stays unsharded after forward (default), the blocks are gathered again
        assert res["seen"] == [(True, True, n + N_BLOCKS, 2 * n)] * 3, (rank, res["seen"])
    assert_parity(two, reference_lm(2, 3, SEED_11))


def backward_after_a_manual_reshard(steps: int = 3):
    """Over one rank, ``model.reshard(recurse=True)`` between forward and
    backward: whether ``blocks[0].fc1`` holds its view when its backward
    runs (its backward pre-hook), per step."""
    model, optim = _sharded_lm("sgd")
    seen = []
    model.blocks[0].fc1.register_full_backward_pre_hook(
        lambda module, _grads: seen.append(type(module.weight) is torch.nn.Parameter))
    for step in range(steps):
        tokens, targets = _local_batch(step, SEED_11)
        loss = model.loss(tokens, targets)
        if step == 1:
            model.reshard(recurse=True)
        loss.backward()
        optim.step()
        optim.zero_grad()
    return {"parameter_in_backward": seen, "params": full_params(model)}


def test_one_rank_backward_after_a_manual_reshard_gathers_the_views_again():
    """Over one rank nothing is gathered in backward while the views stayed
    from forward; after a manual reshard the pre-backward swaps them in
    again (the module attributes in backward are the views, as always), and
    the numbers are one process's."""
    [res] = run_distributed(1, backward_after_a_manual_reshard, timeout=TIMEOUT)
    assert res["parameter_in_backward"] == [False, False, False], res["parameter_in_backward"]
    assert_parity([res], reference_lm(1, 3, SEED_11))


# ============================================================================
# 12. set_gradient_divide_factor / set_force_sum_reduction_for_comms
# ============================================================================
SEED_12 = 12


def grads_with_reduction(setting: str, steps: int = 2):
    """Gradients (this rank's pieces) after each backward, with the setting
    applied on the root only (it must reach every unit)."""
    model = build_lm(N_BLOCKS)
    shard_blocks_and_root(model)
    if setting.startswith("divide-by-"):
        model.set_gradient_divide_factor(float(setting[len("divide-by-"):]))
    elif setting == "force-sum":
        model.set_force_sum_reduction_for_comms(True)
    elif setting != "default":
        raise ValueError(setting)
    optim = make_optim(model.parameters(), "sgd")
    per_step = []
    for step in range(steps):
        tokens, targets = _local_batch(step, SEED_12)
        model.loss(tokens, targets).backward()
        per_step.append(grad_pieces(model))
        optim.step()
        optim.zero_grad()
    return {"grads": per_step, "params": full_params(model)}


def _assembled(results):
    steps = len(results[0]["grads"])
    return [assemble_grads([res["grads"][step] for res in results]) for step in range(steps)]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("factor", [1.0, 3.0], ids=["sum", "divide-by-3"])
def test_gradient_divide_factor(factor, world):
    """Reduced gradient = sum over ranks / factor = (world / factor) x the
    gradient of the global mean loss; factor 1.0 gives world x the default.
    Over one rank nothing is communicated: the division alone."""
    results = run_distributed(world, grads_with_reduction, f"divide-by-{factor}", timeout=TIMEOUT)
    reference = reference_lm(world, 2, SEED_12, scale=world / factor)
    for step, (got, want) in enumerate(zip(_assembled(results), reference["grads"])):
        assert_dicts_close(got, want, 1e-5, f"step {step}: gradient of ")
    assert_parity(results, reference)


def test_force_sum_reduction_changes_no_numbers():
    default = _assembled(run_distributed(2, grads_with_reduction, "default", timeout=TIMEOUT))
    forced = _assembled(run_distributed(2, grads_with_reduction, "force-sum", timeout=TIMEOUT))
    reference = reference_lm(2, 2, SEED_12)
    for step in range(2):
        what = f"step {step}: forced-sum gradient of "
        assert_dicts_close(forced[step], default[step], 1e-6, what)
        assert_dicts_close(forced[step], reference["grads"][step], 1e-5, what)


# ============================================================================
# 13. set_is_last_backward
# ============================================================================
SEED_13 = 13
MICRO = 3
PER_MICRO = 2


def train_is_last_backward(steps: int = 2, on_block: bool = False):
    """``on_block``: the setting is the model's, so made on a block it holds
    the gradients back just the same (the root reads it)."""
    model, optim = _sharded_lm("adamw")
    published_early = []
    for step in range(steps):
        tokens, targets = _local_batch(step, SEED_13, per_rank=MICRO * PER_MICRO)
        for i, (x, y) in enumerate(zip(tokens.chunk(MICRO), targets.chunk(MICRO))):
            (model.blocks[0] if on_block else model).set_is_last_backward(i == MICRO - 1)
            (model.loss(x, y) / MICRO).backward()
            if i < MICRO - 1:
                published_early.append(any(p.grad is not None for p in model.parameters()))
        optim.step()
        optim.zero_grad()
    return {"params": full_params(model), "published_early": published_early}


@pytest.mark.parametrize("on_block", [False, True])
def test_is_last_backward_false_between_micro_batches_parity(on_block):
    results = run_distributed(2, train_is_last_backward, 2, on_block, timeout=TIMEOUT)
    assert all(not any(res["published_early"]) for res in results), results
    assert_parity(results, reference_lm(2, 2, SEED_13, "adamw", per_rank=MICRO * PER_MICRO))


# ============================================================================
# 14. set_unshard_in_backward(False) on an embedding-only unit
# ============================================================================
SEED_14 = 14


def train_embedding_unit(unshard_in_backward: bool, steps: int = 3):
    model = build_lm(N_BLOCKS)
    fully_shard(model.tok_emb)
    shard_blocks_and_root(model)
    model.set_bucket_cap_mb(0)  # the per-unit structure (tests/runtime/test_bucketing.py counts buckets)
    if not unshard_in_backward:
        model.tok_emb.set_unshard_in_backward(False)
    optim = make_optim(model.parameters(), "sgd")
    counts = None
    for step in range(steps):
        tokens, targets = _local_batch(step, SEED_14)
        counter = CollectiveCounter() if step == 2 else contextlib.nullcontext()
        with counter:
            model.loss(tokens, targets).backward()
        if step == 2:  # steady state: steps 0 and 1 also verify the collective order
            counts = _counts(counter)
        optim.step()
        optim.zero_grad()
    return {"params": full_params(model), "counts": counts}


def test_unshard_in_backward_false_saves_the_embedding_all_gather():
    """Units: tok_emb, 2 blocks, root. Default: 2N-1 = 7 all-gathers per
    step; with ``tok_emb.set_unshard_in_backward(False)`` one fewer. Parity
    in both; the embedding's gradient is still reduce-scattered."""
    n = N_BLOCKS + 2
    reference = reference_lm(2, 3, SEED_14)
    for unshard_in_backward in (True, False):
        results = run_distributed(2, train_embedding_unit, unshard_in_backward, timeout=TIMEOUT)
        expected = 2 * n - 1 - (0 if unshard_in_backward else 1)
        for rank, res in enumerate(results):
            assert res["counts"]["all_gathers"] == expected, (
                f"rank {rank}, unshard_in_backward={unshard_in_backward}: expected {expected} "
                f"all-gathers, got {res['counts']}")
            assert res["counts"]["reduce_scatters"] == n, (rank, res["counts"])
        assert_parity(results, reference)


def misuse_unshard_in_backward():
    """A block whose backward needs its weights, told not to unshard in
    backward: the forward must refuse, and the model stays usable after
    the setting is put back."""
    model = build_lm(N_BLOCKS)
    shard_blocks_and_root(model)
    model.blocks[0].set_unshard_in_backward(False)
    tokens, targets = _local_batch(0, SEED_14)
    try:
        model.loss(tokens, targets).backward()
        message = None
    except RuntimeError as error:
        message = str(error)
    model.blocks[0].set_unshard_in_backward(True)
    model.loss(tokens, targets).backward()  # works again
    return message


def test_unshard_in_backward_false_on_a_unit_that_needs_its_weights_raises():
    for message in run_distributed(2, misuse_unshard_in_backward, timeout=TIMEOUT):
        assert message is not None and "set_unshard_in_backward(False)" in message, message
        assert "'blocks.0'" in message and "nn.Embedding" in message, message


# ============================================================================
# 15. The root's clip_grad_norm_ method
# ============================================================================
SEED_15 = 15
MAX_NORM = 0.1


def train_clipped_by_method(steps: int = 2):
    model, optim = _sharded_lm("sgd")
    norms = []
    for step in range(steps):
        tokens, targets = _local_batch(step, SEED_15)
        model.loss(tokens, targets).backward()
        norms.append(float(model.clip_grad_norm_(MAX_NORM, norm_type=2.0)))
        optim.step()
        optim.zero_grad()
    return {"params": full_params(model), "norms": norms}


def test_root_clip_grad_norm_method_matches_torch_on_one_process():
    world = 3
    results = run_distributed(world, train_clipped_by_method, timeout=TIMEOUT)
    reference = reference_lm(world, 2, SEED_15, max_norm=MAX_NORM)
    assert all(n > 2 * MAX_NORM for n in reference["norms"]), "setup: the norms must be clipped"
    for rank, res in enumerate(results):
        for got, want in zip(res["norms"], reference["norms"]):
            assert abs(got - want) <= 1e-5 * max(1.0, want), (
                f"rank {rank}: total norm {got} vs torch.nn.utils.clip_grad_norm_ {want}")
    assert_parity(results, reference)
