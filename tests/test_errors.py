"""Misuse gets a clear exception naming the module/parameter and the fix,
on every rank, never a hang."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compose import fully_shard
from fsdp_compose.testing import GPT, GPTConfig
from tests._training import shard_blocks_and_root
from tests.harness import run_distributed


def _raises(fn, *fragments):
    """Run ``fn`` and return the message of the exception it raises, after
    checking it names every fragment."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - we inspect the message
        message = f"{type(exc).__name__}: {exc}"
        for fragment in fragments:
            assert fragment in message, f"{fragment!r} not in {message!r}"
        return message
    raise AssertionError("no exception raised")


def annotate_twice():
    model = GPT()
    fully_shard(model.blocks[0])
    return _raises(lambda: fully_shard(model.blocks[0]), "already annotated")


def child_after_parent():
    model = GPT()
    fully_shard(model)
    return _raises(lambda: fully_shard(model.blocks[1]), "blocks.1", "bottom-up")


def tied_weights_in_two_units():
    model = GPT(GPTConfig(tie_embeddings=True))
    fully_shard(model.tok_emb)
    return _raises(lambda: fully_shard(model), "head.weight", "tok_emb.weight", "common ancestor")


def tied_weights_in_common_ancestor_train():
    """The fix the error suggests works: the shared weight lives in the root."""
    model = GPT(GPTConfig(tie_embeddings=True))
    shard_blocks_and_root(model)
    assert model.head.weight is model.tok_emb.weight
    tokens = torch.randint(97, (2, 16))
    model.loss(tokens, tokens).backward()
    return model.tok_emb.weight.grad is not None


def sparse_parameter():
    module = nn.Linear(3, 3)
    module.weight = nn.Parameter(torch.eye(3).to_sparse())
    return _raises(lambda: fully_shard(module), "'weight'", "dense")


def non_contiguous_parameter():
    module = nn.Linear(4, 3)
    module.weight = nn.Parameter(torch.randn(4, 3).t())
    return _raises(lambda: fully_shard(module), "'weight'", "contiguous")


def mixed_devices():
    module = nn.Linear(4, 3)
    module.bias = nn.Parameter(torch.zeros(3, device="meta"))
    return _raises(lambda: fully_shard(module), "'weight'", "'bias'", "meta device",
                   "materialised")


def meta_parameters():
    """Allowed at fully_shard (deferred init); a forward before materialising raises."""
    with torch.device("meta"):
        module = nn.Linear(4, 3)
    fully_shard(module)
    return _raises(lambda: module(torch.randn(2, 4)), "'weight'", "still on the meta device",
                   "fsdp_compose.materialize(model)")


def ranks_disagree_on_shapes():
    width = 8 + dist.get_rank()  # rank 1 builds a different model
    model = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2))
    fully_shard(model[0])
    fully_shard(model)
    return _raises(lambda: model(torch.randn(2, 4)), "disagree", "ranks [1]")


def three_dimensional_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2, 1))
    return _raises(lambda: fully_shard(nn.Linear(2, 2), mesh=mesh), "3-D mesh",
                   "(replicate, shard)")


def wrong_policy_type():
    return _raises(lambda: fully_shard(nn.Linear(2, 2), mp_policy=object()), "mp_policy")


def late_registered_parameter_is_still_detected():
    """A parameter annotated by one unit cannot be claimed by another later."""
    model = GPT()
    fully_shard(model.blocks[0])
    model.blocks[1].stolen = model.blocks[0].ln1.weight
    return _raises(lambda: fully_shard(model), "blocks.1.stolen", "blocks.0.ln1.weight")


def deepcopy_of_an_annotated_model():
    """A copy would share the original's hooks and flat buffers."""
    import copy
    import io
    model = GPT()
    shard_blocks_and_root(model)
    _raises(lambda: copy.deepcopy(model.blocks[0]), "copy", "before fully_shard")
    _raises(lambda: copy.copy(model.blocks[0]), "copy", "before fully_shard")
    _raises(lambda: torch.save(model, io.BytesIO()), "state_dict")
    return _raises(lambda: copy.deepcopy(nn.Sequential(model)), "before fully_shard")


@pytest.mark.parametrize("case", [
    annotate_twice, child_after_parent, tied_weights_in_two_units, sparse_parameter,
    non_contiguous_parameter, mixed_devices, meta_parameters, wrong_policy_type,
    late_registered_parameter_is_still_detected, deepcopy_of_an_annotated_model,
])
def test_misuse_raises_clear_error(case):
    messages = run_distributed(2, case)
    assert all(messages)


def test_tied_weights_in_common_ancestor_work():
    assert all(run_distributed(2, tied_weights_in_common_ancestor_train))


def test_ranks_disagreeing_on_shapes_raise_on_every_rank_without_hanging():
    messages = run_distributed(2, ranks_disagree_on_shapes, timeout=60)
    assert len(messages) == 2


def test_three_dimensional_mesh_is_rejected():
    run_distributed(4, three_dimensional_mesh)


def test_fully_shard_before_init_process_group():
    assert not dist.is_initialized()
    _raises(lambda: fully_shard(nn.Linear(2, 2)), "init_process_group")
