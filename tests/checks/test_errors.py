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


def ddp_around_an_annotated_model():
    """DDP's constructor refuses it on every rank, before its shape check
    (a collective): the message names the trainer mixin; DDP around an
    unannotated model is untouched."""
    from torch.nn.parallel import DistributedDataParallel
    model = shard_blocks_and_root(GPT())
    message = _raises(lambda: DistributedDataParallel(model), "TypeError", "annotated by fully_shard",
                      "ShardedTrainerMixin", "ModelParallelStrategy")
    DistributedDataParallel(nn.Linear(3, 2))
    return message


def annotate_twice():
    model = GPT()
    fully_shard(model.blocks[0])
    return _raises(lambda: fully_shard(model.blocks[0]), "already annotated")


def child_after_parent():
    model = GPT()
    fully_shard(model)
    return _raises(lambda: fully_shard(model.blocks[1]), "blocks.1", "bottom-up")


def tied_weights_in_two_units():
    """Units on different meshes cannot share a tied weight (units on one
    mesh can: tests/core/test_tied_units.py)."""
    from torch.distributed.device_mesh import init_device_mesh
    model = GPT(GPTConfig(tie_embeddings=True))
    fully_shard(model.tok_emb)
    other = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("r", "s"))
    return _raises(lambda: fully_shard(model, mesh=other), "head.weight", "tok_emb.weight",
                   "different meshes", "common ancestor")


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
    """A parameter of one unit registered in a module of another unit on
    another mesh is refused under both names, also when registered after
    the first unit's annotation."""
    from torch.distributed.device_mesh import init_device_mesh
    model = GPT()
    fully_shard(model.blocks[0])
    model.blocks[1].stolen = model.blocks[0].ln1.weight
    other = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("r", "s"))
    return _raises(lambda: fully_shard(model, mesh=other), "blocks.1.stolen",
                   "blocks.0.ln1.weight")


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


def ranks_disagree_on_annotated_modules():
    """Same model, but rank 1 does not annotate block 1 (it stays in the root's unit)."""
    model = GPT()
    for i, block in enumerate(model.blocks):
        if not (i == 1 and dist.get_rank() == 1):
            fully_shard(block)
    fully_shard(model)
    tokens = torch.randint(97, (2, 16))
    return _raises(lambda: model(tokens), "disagree", "ranks [1]")


def _sharded_gpt_with_sgd():
    """A GPT with every block and the root annotated, SGD over it, and a batch."""
    model = GPT()
    shard_blocks_and_root(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randint(97, (2, 16))


def step_with_pending_reduce_scatter():
    model, optim, tokens = _sharded_gpt_with_sgd()
    model.set_is_last_backward(False)
    model.loss(tokens, tokens).backward()
    message = _raises(optim.step, "reduce-scatter", "still pending", "set_is_last_backward(True)",
                      "parameter '")
    model.set_is_last_backward(True)  # the fix: the next backward reduces and publishes both
    model.loss(tokens, tokens).backward()
    optim.step()
    return message


def step_with_unreduced_gradients():
    model, optim, tokens = _sharded_gpt_with_sgd()
    model.set_requires_gradient_sync(False)
    model.loss(tokens, tokens).backward()
    message = _raises(optim.step, "not reduced", "set_requires_gradient_sync(True)")
    model.set_requires_gradient_sync(True)
    model.loss(tokens, tokens).backward()
    optim.step()
    return message


def step_inside_forward():
    """optimizer.step() while a unit is unsharded for its forward (here from a
    forward hook inside block 1); the model stays usable."""
    model, optim, tokens = _sharded_gpt_with_sgd()
    handle = model.blocks[1].mlp.register_forward_pre_hook(lambda m, a: optim.step())
    message = _raises(lambda: model(tokens), "optimizer.step() while <root>",
                      "parameter 'tok_emb.weight'", "in its forward", "reset_iter_state()")
    handle.remove()
    model.reset_iter_state()
    model.loss(tokens, tokens).backward()
    optim.step()
    return message


def step_after_unsharded_idle_is_fine():
    """Not a misuse: a unit kept unsharded between iterations (manual
    unshard(), reshard_after_backward=False) notices the step and gathers again."""
    model, optim, tokens = _sharded_gpt_with_sgd()
    model.loss(tokens, tokens).backward()
    model.blocks[0].unshard()
    optim.step()
    model.blocks[0].reshard()
    return True


def submodule_before_root_forward():
    """A unit's forward before its root's first forward sets up the whole
    model from the root: it is not a root of its own afterwards."""
    from fsdp_compose.runtime.state import state_of
    model = GPT()
    shard_blocks_and_root(model)
    with torch.no_grad():
        model.blocks[1](torch.randn(2, 16, 24))
    assert state_of(model).is_root and not state_of(model.blocks[1]).is_root
    tokens = torch.randint(97, (2, 16))
    model.loss(tokens, tokens).backward()
    return state_of(model.blocks[1]).context is state_of(model).context


class _ScalesItsWeightInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.weight.mul_(2)  # the misuse: a parameter changed in place inside forward
        return x * self.weight


def parameter_modified_in_place_in_forward():
    """Forward reads parameters through tensors made once per buffer (see
    [Note: parameter aliases made once]): an in-place change is caught at
    the end of the unit's forward, named, and the model stays usable."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), _ScalesItsWeightInPlace())
    fully_shard(model[1])
    fully_shard(model)
    x = torch.randn(2, 5)
    message = _raises(lambda: model(x), "parameter '1.weight'", "modified in place during forward")
    assert bool((model[1].weight == 1).all()), "the change must not reach the shard"
    model.reset_iter_state()
    model[1].forward = lambda x: x * model[1].weight  # the fix: no in-place change
    model(x).sum().backward()
    assert model[1].weight.grad is not None
    return message


def mesh_without_this_rank():
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh("cpu", [0])  # built on every rank; rank 1 is not in it
    if dist.get_rank() == 0:
        return "rank 0 is in the mesh"
    return _raises(lambda: fully_shard(nn.Linear(2, 2), mesh=mesh), "Linear", "[0]",
                   "does not include this rank (1)")


# ------------------------------------------------ the fixes the messages propose
# Each case makes the mistake, checks the message names the fix, then runs the
# fix as the message writes it and trains a step (docs/errors.md: "fix runs").


def _trains(model: nn.Module, *inputs: torch.Tensor) -> bool:
    """One SGD step on ``model`` changes its (sharded) parameters."""
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    model(*inputs).float().pow(2).mean().backward()
    optim.step()
    return any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def annotate_once_with_a_list():
    """"call fully_shard once per module (use a list for several siblings as one unit)"."""
    model = GPT()
    fully_shard(model.blocks[0])
    _raises(lambda: fully_shard(model.blocks[0]), "once per module", "use a list")
    fixed = GPT()
    fully_shard([fixed.blocks[0], fixed.blocks[1]])  # two siblings, one unit, one call
    fully_shard(fixed)
    return _trains(fixed, torch.randint(97, (2, 16)))


def annotate_bottom_up():
    """"Annotate bottom-up: call fully_shard on children before their parents"."""
    model = GPT()
    fully_shard(model)
    _raises(lambda: fully_shard(model.blocks[1]), "Annotate bottom-up")
    fixed = GPT()
    for block in fixed.blocks:
        fully_shard(block)
    fully_shard(fixed)
    return _trains(fixed, torch.randint(97, (2, 16)))


def make_it_contiguous():
    """"make it contiguous (param.data = param.data.contiguous()) before fully_shard"."""
    module = nn.Linear(4, 3)
    module.weight = nn.Parameter(torch.randn(4, 3).t())
    _raises(lambda: fully_shard(module), "param.data = param.data.contiguous()")
    param = module.weight
    param.data = param.data.contiguous()  # as the message writes it
    fully_shard(module)
    return _trains(module, torch.randn(2, 4))


def materialize_meta_parameters():
    """"Call fsdp_compose.materialize(model)" before the forward."""
    from fsdp_compose import materialize
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    fully_shard(model[0])
    fully_shard(model)
    _raises(lambda: model(torch.randn(2, 4)), "fsdp_compose.materialize(model)")
    model.reset_iter_state()
    materialize(model)
    return _trains(model, torch.randn(2, 4))


def two_dimensional_mesh_instead():
    """A 3-D mesh: "pass ... a 2-D (replicate, shard) mesh (hybrid sharding), e.g.
    init_device_mesh(device_type, (num_replicas, shard_size), mesh_dim_names=...)"."""
    from torch.distributed.device_mesh import init_device_mesh
    three_dimensional_mesh()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = GPT()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _trains(model, torch.randint(97, (2, 16)))


def init_process_group_first():
    """"call torch.distributed.init_process_group(...) first": the harness's
    workers have, and the same fully_shard trains."""
    assert dist.is_initialized()
    model = nn.Linear(8, 6)
    fully_shard(model)
    return _trains(model, torch.randn(3, 8))


@pytest.mark.parametrize("case", [
    annotate_once_with_a_list, annotate_bottom_up, make_it_contiguous,
    materialize_meta_parameters, init_process_group_first,
])
def test_the_proposed_fix_works(case):
    assert all(run_distributed(2, case, timeout=60))


def test_a_two_dimensional_mesh_works_where_a_three_dimensional_one_is_refused():
    assert all(run_distributed(4, two_dimensional_mesh_instead, timeout=60))


@pytest.mark.parametrize("case", [
    ranks_disagree_on_annotated_modules, step_with_pending_reduce_scatter,
    step_with_unreduced_gradients, step_inside_forward, step_after_unsharded_idle_is_fine,
    submodule_before_root_forward, mesh_without_this_rank, parameter_modified_in_place_in_forward,
])
def test_misuse_during_training(case):
    results = run_distributed(2, case, timeout=60)
    assert all(results)
    if case.__name__.startswith("step_with") or case in (step_inside_forward,
                                                          parameter_modified_in_place_in_forward):
        assert results[0] == results[1]  # the same error on every rank


@pytest.mark.parametrize("case", [
    annotate_twice, child_after_parent, tied_weights_in_two_units, sparse_parameter,
    non_contiguous_parameter, mixed_devices, meta_parameters, wrong_policy_type,
    late_registered_parameter_is_still_detected, deepcopy_of_an_annotated_model,
    ddp_around_an_annotated_model,
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
