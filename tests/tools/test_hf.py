"""Hugging Face transformers and PEFT models under fully_shard, on CPU/gloo.

Models are tiny ``LlamaForCausalLM`` built from a config with random weights
(nothing is downloaded). Every test compares with a single process training
or generating on the global batch.
"""

import functools
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tests import _hf  # first: it keeps transformers off the hub

pytest.importorskip("transformers")
pytest.importorskip("peft")

from fsdp_compose import param_info, register_forward_method  # noqa: E402
from fsdp_compose.checks.divergence import VERIFICATION_FORWARD_LIMIT  # noqa: E402
from tests._owners import buffer_of  # noqa: E402
from tests._torchrun_env import run_like_torchrun  # noqa: E402
from fsdp_compose.runtime.state import state_of  # noqa: E402
from tests._comm_counter import ALL_GATHER, REDUCE_SCATTER, CollectiveCounter  # noqa: E402
from tests._training import make_optimizer  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

ATOL = 1e-5
# PEFT calls a transformers method that transformers deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")


def _train(tie, lora, optim_name):
    warnings.filterwarnings("ignore", category=FutureWarning)
    result = _hf.train_sharded(functools.partial(_hf.build_llama, tie, lora),
                               _hf.shard_layers_and_root, optim_name)
    model = result.pop("model")
    result["fqns"] = {n: param_info(p).fqn for n, p in model.named_parameters()}
    result["tied"] = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    # a full checkpoint in the original shapes, on every rank
    result["state_dict"] = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True))
    root = state_of(model).unit
    result["root_owns"] = sorted(n for n, p in model.named_parameters()
                                 if any(buffer_of(p) is b for b in root.buffers))
    return result


# ------------------------------------------------------------------ 1. Llama
@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_llama_training_parity_and_reload(optim_name):
    results = run_distributed(2, _train, False, False, optim_name)
    build = functools.partial(_hf.build_llama, False, False)
    reference = _hf.train_reference(build, 2, optim_name)
    for res in results:
        assert res["same_names"]
        assert _hf.max_diff(res, reference) <= ATOL
        # original FQNs, also as param_info reports them
        assert "model.layers.0.self_attn.q_proj.weight" in res["params"]
        assert all(fqn == name for name, fqn in res["fqns"].items())
    # the gathered weights load into a fresh unsharded model: same logits
    fresh = build()
    fresh.load_state_dict(results[0]["state_dict"], strict=True)
    ids = _hf.batch(99, 2)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits,
                                   reference["model"](input_ids=ids).logits, atol=ATOL, rtol=0)


@pytest.mark.slow  # ~30 s; two ranks: test_llama_training_parity_and_reload
def test_llama_on_three_ranks_with_padding():
    results = run_distributed(3, _train, False, False, "adamw")
    reference = _hf.train_reference(functools.partial(_hf.build_llama, False, False), 3, "adamw")
    for res in results:
        assert _hf.max_diff(res, reference) <= ATOL


# ------------------------------------------------------ 2. tied embeddings
def test_tied_embeddings_live_in_the_root_unit():
    results = run_distributed(2, _train, True, False, "adamw")
    reference = _hf.train_reference(functools.partial(_hf.build_llama, True, False), 2, "adamw")
    for res in results:
        assert res["tied"]  # still one Parameter object after fully_shard and training
        assert "model.embed_tokens.weight" in res["root_owns"]
        assert "lm_head.weight" not in res["params"]  # named_parameters lists a tied one once
        assert _hf.max_diff(res, reference) <= ATOL
    fresh = _hf.build_llama(tie=True)
    fresh.load_state_dict(results[0]["state_dict"], strict=True)  # holds both tied names
    ids = _hf.batch(99, 2)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits,
                                   reference["model"](input_ids=ids).logits, atol=ATOL, rtol=0)


# The embedding or the head a unit of its own (the tie across units):
# tests/core/test_tied_units.py.


# ------------------------------------------------------------ 3. PEFT LoRA
def _lora_step_traffic():
    """Train 3 LoRA steps (counting the collectives of the third), then
    report what holds gradients, optimizer state and reduce-scatter bytes."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _hf.build_llama(lora=True)
    names = {p: n for n, p in model.named_parameters()}
    _hf.shard_layers_and_root(model)
    optim = make_optimizer(model, "adamw")
    losses, counters = [], []
    for step in range(3):
        ids = _hf.local(_hf.batch(step, world), rank, world)
        with CollectiveCounter() as comm:
            loss = _hf.lm_loss(model, ids)
            loss.backward()
        counters.append(comm)
        optim.step()
        optim.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    # after one more backward (no optimizer step yet), gradients are in place
    _hf.lm_loss(model, _hf.local(_hf.batch(3, world), rank, world)).backward()
    with_grad = sorted(names[p] for p in model.parameters() if p.grad is not None)
    buffers = {id(b): b for p in model.parameters() if (b := buffer_of(p)) is not None}
    frozen = [b for b in buffers.values() if not b.requires_grad]
    optim_state = sorted(names[p] for p in optim.state)
    optim.zero_grad()
    adapter_per_unit = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            unit = name.split(".layers.")[1].split(".")[0] if ".layers." in name else "root"
            adapter_per_unit[unit] = adapter_per_unit.get(unit, 0) + param_info(p).numel
    comm = counters[2]  # a steady-state step (steps 0 and 1 also verify the collective order)
    return {
        "losses": losses,
        "params": _hf.full_params(model),
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "with_grad": with_grad,
        "optim_state": optim_state,
        "frozen_buffers": len(frozen),
        "frozen_grads": [b.grad.sharded_grad is not None or b.unsharded.grad is not None
                         or b.unsharded.requires_grad for b in frozen],
        "rs_bytes": comm.bytes[REDUCE_SCATTER], "rs_count": comm.counts[REDUCE_SCATTER],
        "ag_count": comm.counts[ALL_GATHER],
        "adapter_per_unit": adapter_per_unit,
        "trainable_layouts": sorted((b.layout.numel, b.layout.padded_numel)
                                    for b in buffers.values() if b.requires_grad),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_peft_lora_grads_optimizer_state_and_traffic(world):
    results = run_distributed(world, _lora_step_traffic)
    reference = _hf.train_reference(functools.partial(_hf.build_llama, False, True), world, "adamw")
    for res in results:
        assert _hf.max_diff(res, reference) <= ATOL
        assert res["trainable"] and all(".lora_" in n for n in res["trainable"])
        # only adapters get gradients and optimizer state
        assert res["with_grad"] and set(res["with_grad"]) <= set(res["trainable"])
        assert res["optim_state"] and set(res["optim_state"]) <= set(res["trainable"])
        # frozen base weights: no gradient memory at all
        assert res["frozen_buffers"] == 3 and not any(res["frozen_grads"])
        # reduce-scatter traffic is exactly the (padded) adapters' buffers: the
        # counter sees each rank's output chunk, world x that is the input. Under
        # the default placement ("rows") the padding depends on the adapters' rows
        # (docs/placements.md), so it is taken from the buffers' layouts, which
        # hold exactly the adapters (one trainable buffer per layer)
        layouts = res["trainable_layouts"]
        assert [numel for numel, _ in layouts] == sorted(res["adapter_per_unit"].values())
        padded = sum(padded_numel for _, padded_numel in layouts)
        # the two layers' adapters (no root adapter) in one bucket: one reduce-scatter
        assert len(res["adapter_per_unit"]) == 2 and res["rs_count"] == 1
        assert res["rs_bytes"] * world == padded * 4
        # the root (frozen) and the layers' bucket (frozen + adapters of each)
        # in forward; in backward, where it is the first bucket reached, each
        # layer's two buffers alone
        assert res["ag_count"] == 6


# ----------------------------------------------- 7. register_forward_method
def _generate(lora, register):
    warnings.filterwarnings("ignore", category=FutureWarning)
    model = _hf.build_llama(lora=lora)
    model.eval()
    _hf.shard_layers_and_root(model)
    if register:
        register_forward_method(model, "generate")
        register_forward_method(model, "generate")  # idempotent
    ids = _hf.batch(5, 1)[:, :6]
    with torch.no_grad():  # the first forwards also verify that ranks agree (more all-gathers)
        for _ in range(VERIFICATION_FORWARD_LIMIT):
            model(input_ids=ids)
    with CollectiveCounter() as comm:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=4, do_sample=False)
    # resharded after generate: every parameter is this rank's piece again,
    # (rows_here, *rest) under the default placement
    infos = {n: (tuple(p.shape), param_info(p)) for n, p in model.named_parameters()}
    return {"tokens": out, "all_gathers": comm.counts[ALL_GATHER],
            "sharded_after": all(len(shape) == len(info.shape) and shape[1:] == info.shape[1:]
                                 and math.prod(shape) == info.local_numel
                                 for shape, info in infos.values())
            and any(info.local_numel < info.numel for _, info in infos.values())}


def _generate_reference(lora):
    model = _hf.build_llama(lora=lora)
    model.eval()
    ids = _hf.batch(5, 1)[:, :6]
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                          max_new_tokens=4, do_sample=False)


@pytest.mark.parametrize("lora", [False, True])
def test_register_forward_method_generate(lora):
    """Greedy generation on 2 ranks equals the unsharded model's. A PEFT
    model's generate never calls PeftModel.forward, so without registration
    the root unit would stay sharded; with it, the root is gathered once for
    the whole generate and each layer once per generated token."""
    reference = _generate_reference(lora)
    steps = 4  # new tokens: one forward each
    for res in run_distributed(2, _generate, lora, True):
        assert torch.equal(res["tokens"], reference)
        assert res["sharded_after"]
        assert res["all_gathers"] == 1 + 2 * steps
    if not lora:
        # plain HF generate calls model(...) per token: works unregistered,
        # but gathers the root once per token
        for res in run_distributed(2, _generate, False, False):
            assert torch.equal(res["tokens"], reference)
            assert res["all_gathers"] == 3 * steps


def _message(fn):
    try:
        fn()
    except (ValueError, AttributeError) as exc:
        return str(exc)
    return "no error"


def _register_errors():
    model = _hf.build_llama()
    errors = [_message(lambda: register_forward_method(model, "generate"))]
    _hf.shard_layers_and_root(model)
    errors.append(_message(lambda: register_forward_method(model, "forward")))
    errors.append(_message(lambda: register_forward_method(model, "no_such_method")))
    return errors


def test_register_forward_method_errors():
    errors = run_distributed(1, _register_errors)[0]
    assert "not annotated by fully_shard" in errors[0]
    assert "forward already" in errors[1]
    assert "no method 'no_such_method'" in errors[2]


# ------------------------------------ 8. parameters added after fully_shard
def _added_after_annotation(kind):
    model = _hf.build_llama()
    model.to(torch.device("cpu"))  # .to() before annotation is fine
    buffers_before = {n: b.clone() for n, b in model.named_buffers()}
    _hf.shard_layers_and_root(model)
    layer = model.model.layers[0]
    if kind == "new-param":
        layer.mlp.scale = nn.Parameter(torch.ones(3))
    elif kind == "replaced-param":
        layer.mlp.up_proj.weight = nn.Parameter(torch.zeros(72, 40))
    elif kind == "new-module":
        layer.extra = nn.Linear(2, 2)
    elif kind == "root-param":
        model.model.norm.bias = nn.Parameter(torch.zeros(40))
    elif kind == "new-buffer":
        layer.register_buffer("counter", torch.zeros(1))
    ids = _hf.batch(0, 1)
    try:
        loss = _hf.lm_loss(model, ids)
        loss.backward()
    except RuntimeError as exc:
        return {"error": str(exc)}
    buffers_after = dict(model.named_buffers())
    same = all(torch.equal(buffers_after[n], b) for n, b in buffers_before.items())
    return {"error": None, "buffers_same": same, "loss": loss.item()}


@pytest.mark.parametrize("kind,fqn", [
    ("new-param", "model.layers.0.mlp.scale"),
    ("replaced-param", "model.layers.0.mlp.up_proj.weight"),
    ("new-module", "model.layers.0.extra.weight"),
    ("root-param", "model.norm.bias"),
])
def test_parameter_added_after_fully_shard_is_an_error(kind, fqn):
    for res in run_distributed(2, _added_after_annotation, kind):
        assert res["error"] is not None, "silently accepted"
        assert f"'{fqn}'" in res["error"] and "after fully_shard" in res["error"]


def test_buffers_stay_untouched_and_usable():
    reference = _hf.build_llama()
    with torch.no_grad():
        want = _hf.lm_loss(reference, _hf.batch(0, 1)).item()
    for res in run_distributed(2, _added_after_annotation, "new-buffer"):
        assert res["error"] is None and res["buffers_same"]  # rotary inv_freq etc.
        assert abs(res["loss"] - want) <= ATOL


# --------------------------------------------------------------- example
def test_lora_example_runs(tmp_path):
    """examples/lora_finetune.py end to end (tiny sizes) on 2 ranks, each started as
    torchrun starts a worker (tests/_torchrun_env.py)."""
    root = Path(__file__).resolve().parents[2]
    proc = run_like_torchrun(2, "examples/lora_finetune.py", "--steps", "3", "--layers", "2",
                             "--hidden", "64", "--seq", "16",
                             "--save-adapter", str(tmp_path / "adapter"), cwd=root, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "trainable" in proc.stdout and "generated" in proc.stdout
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
