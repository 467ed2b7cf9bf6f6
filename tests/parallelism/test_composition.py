"""fully_shard composed with torch's other composable pieces, on a tiny
Hugging Face Llama: activation checkpointing (three ways), torch.compile,
and replicate (DDP) on the rest of the model.
"""

import functools
import warnings

import pytest
import torch.distributed as dist

from tests import _hf  # first: it keeps transformers off the hub

pytest.importorskip("transformers")

from fsdp_compose import fully_shard  # noqa: E402
from tests._owners import buffer_of  # noqa: E402
from tests._comm_counter import ALL_GATHER, REDUCE_SCATTER, CollectiveCounter  # noqa: E402
from tests._training import make_optimizer  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

ATOL = 1e-5
WRAPPED = "_checkpoint_wrapped_module."
# PEFT calls a transformers method that transformers deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")


# ------------------------------------------------- activation checkpointing
def _wrapper_ac(model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    apply_activation_checkpointing(
        model, check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                checkpoint_impl=CheckpointImpl.NO_REENTRANT))


def _composable_ac(model):
    from torch.distributed._composable import checkpoint
    for layer in _hf.decoder_layers(model):
        checkpoint(layer)


def annotate_with_ac(model, how):
    """fully_shard every decoder layer and the root, with activation
    checkpointing of the same layers applied ``how``."""
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    if how == "hf":  # torch.utils.checkpoint(use_reentrant=False) inside each layer's forward
        hf_model.activation_checkpointing_enable({"use_reentrant": False})
    elif how == "hf-reentrant":
        hf_model.activation_checkpointing_enable({"use_reentrant": True})
    elif how == "wrapper-before":
        _wrapper_ac(model)
    elif how == "composable-before":
        _composable_ac(model)
    if how == "wrapper-before":  # the layers list now holds the CheckpointWrappers
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
        for wrapper in [m for m in model.modules() if isinstance(m, CheckpointWrapper)]:
            fully_shard(wrapper)
        fully_shard(model)
    else:
        _hf.shard_layers_and_root(model)
    if how == "wrapper-after":
        _wrapper_ac(model)
    elif how == "composable-after":
        _composable_ac(model)


def _train_with_ac(how, lora=False):
    """3 training steps; counts the collectives and the saved activation
    bytes of the third (steady-state) step: the first two also verify the
    collective order across ranks."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _hf.build_llama(lora=lora)
    model.train()
    annotate_with_ac(model, how)
    optim = make_optimizer(model, "adamw")
    bases = {id(b): b.unsharded for p in model.parameters()
             if (b := buffer_of(p)) is not None}.values()
    losses, stats = [], {}
    for step in range(3):
        ids = _hf.local(_hf.batch(step, world), rank, world)
        with CollectiveCounter() as comm:
            with _hf.SavedActivations(bases) as saved:
                loss = _hf.lm_loss(model, ids)
            loss.backward()
        if step == 2:
            stats = {"saved_bytes": saved.nbytes, "all_gathers": comm.counts[ALL_GATHER],
                     "reduce_scatters": comm.counts[REDUCE_SCATTER]}
        optim.step()
        optim.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    params = {n.replace(WRAPPED, ""): t for n, t in _hf.full_params(model).items()}
    return {"losses": losses, "params": params, **stats}


@functools.cache
def _reference(world: int, lora: bool) -> dict:
    """One process on the global batch of ``world`` ranks, AdamW, 3 steps:
    once per configuration (callers only read it)."""
    return _hf.train_reference(functools.partial(_hf.build_llama, False, lora), world, "adamw")


@functools.cache
def _without_ac(world: int, lora: bool) -> list[dict]:
    """``_train_with_ac`` without checkpointing, once per configuration:
    what each checkpointed run is compared with (callers only read it)."""
    return run_distributed(world, _train_with_ac, "none", lora)


@pytest.fixture(scope="module")
def ac_reference():
    return _reference(2, False)


@pytest.fixture(scope="module")
def no_ac():
    return _without_ac(2, False)


@pytest.mark.parametrize("how", ["hf", "hf-reentrant", "wrapper-before", "wrapper-after",
                                 "composable-before", "composable-after"])
def test_activation_checkpointing(how, ac_reference, no_ac):
    for res, plain in zip(run_distributed(2, _train_with_ac, how), no_ac):
        assert _hf.max_diff(res, ac_reference) <= ATOL
        assert _hf.max_diff(plain, ac_reference) <= ATOL
        # recomputation runs while the layer is unsharded for backward: no
        # second all-gather (the two layers are one bucket: the root and the
        # bucket in forward; in backward, the first bucket it reaches, each
        # layer alone; root not again)
        assert res["all_gathers"] == plain["all_gathers"] == 4
        assert res["reduce_scatters"] == plain["reduce_scatters"] == 2
        # the layers' activations are not kept (only their inputs)
        assert res["saved_bytes"] < 0.5 * plain["saved_bytes"], (res["saved_bytes"],
                                                                 plain["saved_bytes"])


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("how", ["hf", "composable-after"])
def test_activation_checkpointing_over_one_rank(how, lora):
    """Over one rank the layers keep their views from forward to backward
    (a reshard would free nothing): recomputation runs on them, trainable
    or frozen, with no collective."""
    reference = _reference(1, lora)
    [res] = run_distributed(1, _train_with_ac, how, lora)
    [plain] = _without_ac(1, lora)
    assert _hf.max_diff(res, reference) <= ATOL
    assert res["all_gathers"] == res["reduce_scatters"] == 0
    assert res["saved_bytes"] < 0.5 * plain["saved_bytes"], (res["saved_bytes"],
                                                             plain["saved_bytes"])


@pytest.mark.parametrize("how", ["hf", "wrapper-before", "composable-after"])
def test_activation_checkpointing_with_lora(how):
    """Frozen base weights (resharded once the layer's input gradients exist)
    and recomputation together."""
    reference = _reference(2, True)
    plain = _without_ac(2, True)
    for res, base in zip(run_distributed(2, _train_with_ac, how, True), plain):
        assert _hf.max_diff(res, reference) <= ATOL
        # root frozen; per layer frozen + adapters, the two layers one bucket:
        # root and bucket in forward; in backward each layer's two buffers
        # alone (the first bucket backward reaches); the bucket's adapters reduced
        assert res["all_gathers"] == base["all_gathers"] == 6
        assert res["reduce_scatters"] == base["reduce_scatters"] == 1
        assert res["saved_bytes"] < 0.5 * base["saved_bytes"]


# ---------------------------------------------------------------- compile
def _compile_layers(model, backend):
    _hf.shard_layers_and_root(model)
    for layer in _hf.decoder_layers(model):
        layer.compile(backend=backend)  # in place: FQNs unchanged


def _train_compiled(backend):
    warnings.filterwarnings("ignore", category=FutureWarning)
    from torch._dynamo.utils import counters
    counters.clear()
    frames = []
    result = _hf.train_sharded(_hf.build_llama, functools.partial(_compile_layers, backend=backend),
                               "adamw", steps=3,
                               step_hook=lambda m, s: frames.append(counters["stats"]["unique_graphs"]))
    result.pop("model")
    result["graphs_per_step"] = frames
    return result


def test_compiled_layers_parity():
    results = run_distributed(2, _train_compiled, "aot_eager", timeout=300)
    reference = _reference(2, False)
    for res in results:
        assert res["same_names"]
        assert _hf.max_diff(res, reference) <= ATOL
        # both layers share one graph (same code, same guards), compiled once
        assert res["graphs_per_step"][0] >= 1
        assert res["graphs_per_step"] == res["graphs_per_step"][:1] * 3, "recompiled"


# -------------------------------------------------------------- replicate
def _annotate_with_replicate(model, how):
    from torch.distributed._composable import replicate
    layers = _hf.decoder_layers(model)
    if how == "replicate-root":  # layers sharded; embeddings, final norm, head replicated
        for layer in layers:
            fully_shard(layer)
        replicate(model)
    elif how == "replicate-child":  # layer 0 replicated inside a fully_shard root
        replicate(layers[0])
        fully_shard(layers[1])
        fully_shard(model)


def _train_replicate(how):
    warnings.filterwarnings("ignore", category=FutureWarning)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _hf.build_llama()
    _annotate_with_replicate(model, how)
    optim = make_optimizer(model, "adamw")
    losses = []
    for step in range(3):
        with CollectiveCounter() as comm:
            loss = _hf.lm_loss(model, _hf.local(_hf.batch(step, world), rank, world))
            loss.backward()
        optim.step()
        optim.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return {"losses": losses, "params": _hf.full_params(model),
            "sharded": sorted(n for n, p in model.named_parameters()
                              if buffer_of(p) is not None),
            "collectives": {str(op).split(".")[-2]: n for op, n in comm.counts.items()}}


@pytest.mark.parametrize("how", ["replicate-root", "replicate-child"])
def test_replicate_and_fully_shard_on_different_subtrees(how):
    results = run_distributed(2, _train_replicate, how)
    reference = _reference(2, False)
    for res in results:
        assert _hf.max_diff(res, reference) <= ATOL
        names = set(res["params"])
        if how == "replicate-root":
            assert set(res["sharded"]) == {n for n in names if n.startswith("model.layers.")}
            # each layer is a root of its own (no fully_shard ancestor), and a
            # root keeps its parameters from forward to backward: 1 all-gather each
            assert res["collectives"]["_allgather_base_"] == 2
        else:
            assert set(res["sharded"]) == {n for n in names
                                           if not n.startswith("model.layers.0.")}
            assert res["collectives"]["_allgather_base_"] == 3  # root, layer 1, layer 1 again
        assert res["collectives"]["_reduce_scatter_base_"] == 2
        # DDP's one gradient bucket, and fully_shard's used-parameter flags
        # (one per model: each fully_shard root below replicate is its own)
        roots = 2 if how == "replicate-root" else 1
        assert res["collectives"]["allreduce_"] == 1 + roots


def _both_on_one_module(order):
    from torch.distributed._composable import replicate
    model = _hf.build_llama()
    layer = model.model.layers[0]
    try:
        if order == "replicate-then-shard":
            replicate(layer)
            fully_shard(layer)
        elif order == "shard-then-replicate":
            fully_shard(layer)
            replicate(layer)
        else:  # replicate a module whose parameters an ancestor's unit already took
            fully_shard(model)
            replicate(layer)
            _hf.lm_loss(model, _hf.batch(0, 1))
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("order,fragment", [
    ("replicate-then-shard", "already annotated by replicate()"),
    ("shard-then-replicate", "already managed by `fully_shard`"),  # torch's own check
    ("replicate-inside-sharded", "'model.layers.0' was annotated by replicate() after fully_shard"),
])
def test_replicate_and_fully_shard_on_one_module_is_an_error(order, fragment):
    for message in run_distributed(2, _both_on_one_module, order):
        assert fragment in message, message
