"""Hugging Face's ``Trainer`` with fsdp_compose (``ShardedTrainer``) on 2
CPU ranks, against the same script under the plain Trainer, which
accelerate runs with DistributedDataParallel on CPUs (its FSDP plugin is
turned on for GPU-like devices only: with ``use_cpu`` an ``fsdp_config`` is
ignored and DDP runs, checked below). A tiny Llama, with PEFT LoRA and
fully fine-tuned: losses, evaluation losses and gradient norms step by
step (clipping on, gradient accumulation on and off), ``save_model``
writing an adapter that ``PeftModel.from_pretrained`` loads in one process
(or a ``model.safetensors`` for ``from_pretrained``) equal to DDP's, and
``resume_from_checkpoint`` repeating the steps after the checkpoint exactly.
"""

import os
import tempfile
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

from tests._hf import (VOCAB, SEQ, build_llama, decoder_layers, reset_trainer_env,  # noqa: E402
                       trained_adapter)
from fsdp_compose import ShardedModule, fully_shard  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from tests.harness import TEST_DEVICE, run_distributed  # noqa: E402

STEPS, SAVE_EVERY, PER_DEVICE = 6, 3, 2
TIMEOUT = 300  # s: the first call imports transformers (and datasets) in every worker
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(impl, output_dir, accumulate=1, resume=None, lora=True):
    """``STEPS`` optimizer steps (from the checkpoint's step when resuming),
    a checkpoint every ``SAVE_EVERY``, then ``save_model()``; returns the
    logged loss and gradient norm of each step and the reduce-scatters
    issued (ours). ``lora=False``: full fine-tuning of every parameter.
    ``impl``: "fsdp_compose" (``ShardedTrainer`` over a model annotated by
    hand), "usual" (``ShardedTrainer`` given the unannotated model, as the
    plain Trainer is: it annotates each ``LlamaDecoderLayer`` and the root),
    "ddp" (the plain Trainer) or, in CUDA mode, "fsdp2" (the plain Trainer with accelerate's FSDP2
    plugin; the ranks share the GPU over the harness's gloo group, each
    told it is local rank 0 so that accelerate puts both on ``cuda:0``).
    In CUDA mode nothing is saved: a full-state-dict gather of CUDA
    ``DTensor`` values over gloo inside the collective counter's dispatch mode
    segfaulted in torch 2.11 (``_c_check_aliasing_constraint``), for FSDP2
    and for us; saving is tested on CPUs."""
    from transformers import Trainer, TrainingArguments
    from tests._comm_counter import REDUCE_SCATTER, CollectiveCounter
    cuda = TEST_DEVICE.type == "cuda"
    reset_trainer_env(cuda)
    warnings.filterwarnings("ignore")
    fsdp2 = dict(fsdp=True, fsdp_config={"version": 2, "state_dict_type": "FULL_STATE_DICT",
                                         "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    args = TrainingArguments(
        **(fsdp2 if impl == "fsdp2" else {}), output_dir=output_dir, per_device_train_batch_size=PER_DEVICE, max_steps=STEPS,
        gradient_accumulation_steps=accumulate, learning_rate=5e-3, max_grad_norm=0.25,
        logging_steps=1, save_steps=SAVE_EVERY, save_strategy="no" if cuda else "steps",
        report_to=[],
        eval_strategy="steps", eval_steps=SAVE_EVERY, per_device_eval_batch_size=PER_DEVICE,
        # at the end, reload the checkpoint of step SAVE_EVERY (the "best": its evaluation
        # loss is the higher one), so that what save_model writes shows the reload
        load_best_model_at_end=not cuda, metric_for_best_model="eval_loss", greater_is_better=True,
        use_cpu=not cuda, seed=0, disable_tqdm=True, ddp_backend="gloo", dataloader_num_workers=0)
    model = build_llama(lora=lora)
    refused = refused_bf16 = None
    if impl == "usual":
        from fsdp_compose.integrations.hf import ShardedTrainer as cls
    elif impl == "fsdp_compose":
        model.to(TEST_DEVICE)
        from fsdp_compose.integrations.hf import ShardedTrainer as cls
        for layer in decoder_layers(model):
            fully_shard(layer)
        try:
            cls(model=model, args=args, train_dataset=_Tokens(64), eval_dataset=_Tokens(8))
        except ValueError as e:
            refused = str(e)  # the layers annotated, the root not
        fully_shard(model)
        try:
            bf16 = TrainingArguments(output_dir=output_dir, bf16=True, use_cpu=not cuda,
                                     report_to=[], ddp_backend="gloo")
            cls(model=model, args=bf16, train_dataset=_Tokens(64))
            refused_bf16 = None
        except ValueError as e:
            refused_bf16 = str(e)
        model.set_bucket_cap_mb(0)  # one reduce-scatter per trainable unit and step, to count
    else:
        cls = Trainer  # accelerate wraps (DDP) or shards (FSDP2) it
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        trainer = cls(model=model, args=args, train_dataset=_Tokens(64), eval_dataset=_Tokens(8))
        if impl == "usual":
            trainer.model.set_bucket_cap_mb(0)
        with CollectiveCounter() as counter:
            trainer.train(resume_from_checkpoint=resume)
    if not cuda:
        trainer.save_model()  # the best (reloaded) model
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"steps": [e["step"] for e in logs], "losses": [e["loss"] for e in logs],
            "norms": [e["grad_norm"] for e in logs], "refused": refused, "refused_bf16": refused_bf16,
            "eval": [(e["step"], e["eval_loss"]) for e in trainer.state.log_history
                     if "eval_loss" in e],
            "reduce_scatters": counter.counts[REDUCE_SCATTER],
            "total_flos": trainer.state.total_flos,
            "our_warnings": [str(w.message) for w in warned if "fsdp_compose" in str(w.message)
                             and not str(w.message).startswith("fsdp_compose.flat_step:")],
            # the Trainer's fused AdamW is stepped by torch, said in one line (not an alarm)
            "flat_step_notices": [str(w.message) for w in warned
                                  if str(w.message).startswith("fsdp_compose.flat_step:")],
            "units": sum(isinstance(m, ShardedModule) for m in trainer.model.modules()),
            "wrapped": type(trainer.model_wrapped).__name__,
            "torch_fsdp2_units": sum(isinstance(m, FSDPModule) for m in trainer.model.modules())}




def _run(*args, **kwargs):
    """``_train`` on 2 ranks; the results by rank."""
    return run_distributed(2, _train, *args, timeout=TIMEOUT, **kwargs)


def _close(a, b, **tol):
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6, **tol)


CPU_ONLY = pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="accelerate runs DDP on CPUs only")


@CPU_ONLY
def test_trainer_matches_ddp_saves_adapter_and_resumes_exactly():
    with tempfile.TemporaryDirectory() as tmp:
        ddp = _run("ddp", os.path.join(tmp, "ddp"))[0]
        ours = _run("usual", os.path.join(tmp, "ours"))[0]
        assert ours["units"] == 3  # the two decoder layers and the root
        assert ours["steps"] == ddp["steps"] == list(range(1, STEPS + 1))
        # the Trainer's no-decay group is empty for LoRA by its name rule: no warning about it
        assert ours["our_warnings"] == []
        assert all("fused=True" in n for n in ours["flat_step_notices"]), ours["flat_step_notices"]
        assert ours["total_flos"] == ddp["total_flos"] > 0  # whole parameters, not the shards
        _close(ours["losses"], ddp["losses"])
        _close(ours["norms"], ddp["norms"])
        assert [step for step, _ in ours["eval"]] == [SAVE_EVERY, STEPS]  # evaluation mid-run
        _close(ours["eval"], ddp["eval"])
        assert min(ddp["norms"]) < 0.25 < max(ddp["norms"])  # some steps clipped, some not
        assert ours["wrapped"] == "ShardedPeftModel"  # no DistributedDataParallel around it
        assert ddp["wrapped"] == "DistributedDataParallel"

        saved, expected = trained_adapter(os.path.join(tmp, "ours")), trained_adapter(os.path.join(tmp, "ddp"))
        initial = {n: p for n, p in build_llama(lora=True).named_parameters() if "lora_" in n}
        assert saved.keys() == expected.keys() == initial.keys() and len(saved) == 8
        _close(saved, expected)
        assert all(not torch.equal(saved[n], initial[n]) for n in saved)  # trained, not the init
        # load_best_model_at_end reloaded step SAVE_EVERY's adapter into the sharded model
        _close(saved, trained_adapter(os.path.join(tmp, "ours", f"checkpoint-{SAVE_EVERY}")))
        last = trained_adapter(os.path.join(tmp, "ours", f"checkpoint-{STEPS}"))
        assert all(not torch.equal(saved[n], last[n]) for n in saved)

        checkpoint = os.path.join(tmp, "ours", f"checkpoint-{SAVE_EVERY}")
        assert os.path.isdir(os.path.join(checkpoint, "optimizer"))
        resumed = _run("usual", os.path.join(tmp, "ours"),
                                  resume=checkpoint)[0]
        assert resumed["steps"] == ours["steps"]
        assert resumed["losses"] == ours["losses"] and resumed["norms"] == ours["norms"]
        assert resumed["eval"] == ours["eval"]
        _close(trained_adapter(os.path.join(tmp, "ours")), saved)


@CPU_ONLY
@pytest.mark.slow  # ~12 s; accumulation with full fine-tuning is in the fast set
def test_trainer_lora_gradient_accumulation_reduces_once_per_step():
    with tempfile.TemporaryDirectory() as tmp:
        ddp = _run("ddp", os.path.join(tmp, "ddp"), accumulate=2)[0]
        ours = _run("fsdp_compose", os.path.join(tmp, "ours"), accumulate=2)[0]
        once = _run("fsdp_compose", os.path.join(tmp, "once"))[0]
    _close(ours["losses"], ddp["losses"])
    _close(ours["norms"], ddp["norms"])
    # two micro-batches per step, the reductions of one (the first runs under no_sync):
    # one reduce-scatter per step for each layer's LoRA parameters
    assert ours["reduce_scatters"] == once["reduce_scatters"] == 2 * STEPS


def _full_weights(directory):
    """``model.safetensors`` that ``save_model`` wrote, loaded by
    ``LlamaForCausalLM.from_pretrained`` in this (one) process."""
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(directory)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@CPU_ONLY
def test_trainer_full_fine_tuning_accumulates_saves_and_resumes_exactly():
    """Every parameter trained (no PEFT), two micro-batches per step: DDP's
    losses, reductions once per step, ``model.safetensors`` equal to DDP's,
    an exact resume."""
    with tempfile.TemporaryDirectory() as tmp:
        ours_dir = os.path.join(tmp, "ours")
        ddp = _run("ddp", os.path.join(tmp, "ddp"), accumulate=2,
                              lora=False)[0]
        ours = _run("fsdp_compose", ours_dir, accumulate=2, lora=False)[0]
        assert "not its root" in ours["refused"] and "fully_shard(model)" in ours["refused"]
        # bf16=True against units annotated in full precision: refused, naming both
        assert "bf16=True" in ours["refused_bf16"] and "full precision" in ours["refused_bf16"]
        saved = _full_weights(ours_dir)
        resumed = _run("fsdp_compose", ours_dir, accumulate=2, lora=False,
                                  resume=os.path.join(ours_dir, f"checkpoint-{SAVE_EVERY}"))[0]
        _close(saved, _full_weights(os.path.join(tmp, "ddp")))
        _close(_full_weights(ours_dir), saved)
    _close(ours["losses"], ddp["losses"])
    _close(ours["norms"], ddp["norms"])
    # one reduce-scatter per unit (two layers and the root) and step
    assert ours["reduce_scatters"] == 3 * STEPS
    assert resumed["losses"] == ours["losses"] and resumed["norms"] == ours["norms"]


@pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="CUDA mode only (make test-gpu)")
@pytest.mark.parametrize("accumulate", [1, 2])
def test_trainer_on_a_gpu_matches_accelerate_fsdp2(accumulate):
    """On a GPU accelerate's FSDP2 plugin runs (on CPUs it falls back to
    DDP): the same LoRA script under it and under ``ShardedTrainer``, both
    ranks on the one GPU: losses, gradient norms and the evaluation losses
    (the last one after the final step: the trained adapters agree)."""
    with tempfile.TemporaryDirectory() as tmp:
        fsdp2 = _run("fsdp2", os.path.join(tmp, "fsdp2"),
                                accumulate=accumulate)[0]
        ours = _run("fsdp_compose", os.path.join(tmp, "ours"),
                               accumulate=accumulate)[0]
    assert fsdp2["torch_fsdp2_units"] >= 3  # the decoder layers and the root: FSDP2 did run
    assert ours["torch_fsdp2_units"] == 0 and ours["wrapped"] == "ShardedPeftModel"
    assert ours["steps"] == fsdp2["steps"] == list(range(1, STEPS + 1))
    tol = dict(rtol=0, atol=1e-5)
    torch.testing.assert_close(ours["losses"], fsdp2["losses"], **tol)
    torch.testing.assert_close(ours["norms"], fsdp2["norms"], **tol)
    torch.testing.assert_close(ours["eval"], fsdp2["eval"], **tol)
    assert [step for step, _ in ours["eval"]] == [SAVE_EVERY, STEPS]
    assert ours["reduce_scatters"] == 2 * STEPS  # once per step and LoRA unit


def _annotated_from_config():
    """What each ``fsdp_config`` key does to the units (no trainer)."""
    from types import SimpleNamespace
    from torch.distributed._composable.checkpoint_activation import checkpoint
    from fsdp_compose import CPUOffloadPolicy
    from fsdp_compose.integrations.hf import _annotate, _precision
    from fsdp_compose.runtime.state import state_of
    args = SimpleNamespace(fsdp_config={"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                        "reshard_after_forward": "false", "cpu_offload": True,
                                        "activation_checkpointing": True, "version": 2})
    model = build_llama(lora=True)
    names = _annotate.annotate(model, _annotate.fsdp_config(args), _precision.policy_for(torch.bfloat16))
    units = [m for m in model.modules() if isinstance(m, ShardedModule)]
    settings = [state_of(m).unit.settings for m in units]
    fallback = build_llama()  # no fsdp_config: the model's _no_split_modules
    fallback_names = _annotate.annotate(fallback, {}, None)
    try:
        _annotate.fsdp_config(SimpleNamespace(fsdp_config={"auto_wrap_policy": "SIZE_BASED_WRAP"}))
        unknown = None
    except ValueError as e:
        unknown = str(e)
    return {"names": names, "fallback_names": fallback_names, "units": len(units),
            "root_annotated": units[0] is model,
            "reshard": {s.reshard_after_forward for s in settings},
            "offload": {type(s.offload_policy) is CPUOffloadPolicy for s in settings},
            "param_dtypes": {s.mp_policy.param_dtype for s in settings},
            "reduce_dtypes": {s.mp_policy.reduce_dtype for s in settings},
            "checkpointed": sum(checkpoint.state(layer) is not None for layer in decoder_layers(model)),
            "fallback_units": sum(isinstance(m, ShardedModule) for m in fallback.modules()),
            "unknown": unknown}


def test_fsdp_config_keys_become_unit_settings():
    got = run_distributed(2, _annotated_from_config)[0]
    assert got["names"] == ["LlamaDecoderLayer"] and got["fallback_names"] == ["LlamaDecoderLayer"]
    assert got["units"] == got["fallback_units"] == 3 and got["root_annotated"]
    assert got["reshard"] == {False} and got["offload"] == {True}
    assert got["param_dtypes"] == {torch.bfloat16} and got["reduce_dtypes"] == {torch.float32}
    assert got["checkpointed"] == 2
    assert "'auto_wrap_policy'" in got["unknown"] and "transformer_layer_cls_to_wrap" in got["unknown"]
