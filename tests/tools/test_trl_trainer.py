"""TRL's ``SFTTrainer`` with fsdp_compose, written as TRL's users write it:
``ShardedSFTTrainer(model=<path>, peft_config=LoraConfig(...), args=SFTConfig(...))``
with ``class ShardedSFTTrainer(ShardedTrainerMixin, SFTTrainer)``, on 2 CPU
ranks against the same script under the plain ``SFTTrainer`` (which
accelerate runs with ``DistributedDataParallel`` on CPUs).

The model path is a tiny Llama and its tokenizer written by
``save_pretrained`` (no hub). Checked: losses and gradient norms step by
step over 12 steps (gradient accumulation 2, clipping, SFTConfig's default
gradient checkpointing), ``total_flos``, no false warning about the LoRA
model's empty no-decay group, the adapter equal to DDP's, an exact resume;
SFTConfig's default ``bf16=True`` (a bf16 ``MixedPrecisionPolicy`` here,
autocast under DDP); and the refusals at construction (an annotated model
plus ``peft_config=``, an annotated model under the plain ``SFTTrainer``).
Skipped without TRL (``pip install -e '.[trl]'``).
"""

import os
import tempfile
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("trl")

from tests._hf import (SEQ, VOCAB, build_llama, reset_trainer_env, save_llama_dir,  # noqa: E402
                       shard_layers_and_root, trained_adapter)
from tests.harness import TEST_DEVICE, run_distributed  # noqa: E402

STEPS, SAVE_AT = 12, 6
TIMEOUT = 600  # s, generous: the first call imports transformers, datasets and trl in every worker
pytestmark = [pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="accelerate runs DDP on CPUs only"),
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                         "ignore::FutureWarning")]


def _config(output_dir, steps, **overrides):
    from trl import SFTConfig
    return SFTConfig(output_dir=output_dir, per_device_train_batch_size=2,
                     gradient_accumulation_steps=2, max_steps=steps, learning_rate=5e-3,
                     max_grad_norm=0.2, logging_steps=1, save_steps=SAVE_AT, report_to=[],
                     use_cpu=True, seed=0, disable_tqdm=True, ddp_backend="gloo",
                     dataloader_num_workers=0, **overrides)


def _data():
    from datasets import Dataset
    ids = torch.randint(3, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(7))
    return Dataset.from_dict({"input_ids": ids.tolist()})


def _lora():
    from peft import LoraConfig
    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def _trainer_class(sharded):
    from trl import SFTTrainer
    if not sharded:
        return SFTTrainer
    from fsdp_compose.integrations.hf import ShardedTrainerMixin

    class ShardedSFTTrainer(ShardedTrainerMixin, SFTTrainer):
        pass
    return ShardedSFTTrainer


def _sft(sharded, model_dir, output_dir, steps=STEPS, resume=None, **config):
    """The user's script: the model path, ``peft_config``, ``SFTConfig``."""
    reset_trainer_env()
    warnings.filterwarnings("ignore")
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        trainer = _trainer_class(sharded)(model=model_dir, peft_config=_lora(),
                                          args=_config(output_dir, steps, **config),
                                          train_dataset=_data())
        trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"steps": [e["step"] for e in logs], "losses": [e["loss"] for e in logs],
            "norms": [e["grad_norm"] for e in logs], "total_flos": trainer.state.total_flos,
            "our_warnings": [str(w.message) for w in warned if "fsdp_compose" in str(w.message)
                             and not str(w.message).startswith("fsdp_compose.flat_step:")],
            # the Trainer's fused AdamW is stepped by torch, said in one line (not an alarm)
            "flat_step_notices": [str(w.message) for w in warned
                                  if str(w.message).startswith("fsdp_compose.flat_step:")],
            "wrapped": type(trainer.model_wrapped).__name__,
            "dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()})}


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_sft_trainer_usual_form_matches_ddp_and_resumes_exactly():
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_llama_dir(os.path.join(tmp, "model"))
        ddp = run_distributed(2, _sft, False, model_dir, os.path.join(tmp, "ddp"), bf16=False,
                              timeout=TIMEOUT)[0]
        ours_dir = os.path.join(tmp, "ours")
        ours = run_distributed(2, _sft, True, model_dir, ours_dir, bf16=False, timeout=TIMEOUT)[0]
        saved = trained_adapter(ours_dir)
        _close(saved, trained_adapter(os.path.join(tmp, "ddp")))
        assert len(saved) == 8  # A and B of q_proj and v_proj in both layers
        resumed = run_distributed(2, _sft, True, model_dir, ours_dir, bf16=False, timeout=TIMEOUT,
                                  resume=os.path.join(ours_dir, f"checkpoint-{SAVE_AT}"))[0]
        _close(trained_adapter(ours_dir), saved)
    assert ddp["wrapped"] == "DistributedDataParallel" and ours["wrapped"] == "ShardedPeftModel"
    assert ours["steps"] == ddp["steps"] == list(range(1, STEPS + 1))
    _close(ours["losses"], ddp["losses"])
    _close(ours["norms"], ddp["norms"])
    assert min(ddp["norms"]) < 0.2 < max(ddp["norms"])  # some steps clipped, some not
    assert ours["total_flos"] == ddp["total_flos"] > 0
    assert ours["our_warnings"] == []  # the Trainer's empty no-decay group of a LoRA model
    assert all("fused=True" in n for n in ours["flat_step_notices"]), ours["flat_step_notices"]
    # the resumed log: steps 1-6 from the checkpoint's trainer state, 7-12 run again
    assert resumed["steps"] == ours["steps"]
    assert resumed["losses"] == ours["losses"] and resumed["norms"] == ours["norms"]


@pytest.mark.parametrize("flags", [{}, {"bf16": False, "fp16": True}], ids=["default_bf16", "fp16"])
def test_sft_trainer_low_precision_trains_close_to_ddp(flags):
    """SFTConfig's default ``bf16=True`` (and ``fp16=True``, with a gradient
    scaler): low-precision compute, fp32 shards and reductions here;
    autocast under DDP. Not bitwise the same computation: finite losses
    close to DDP's."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_llama_dir(os.path.join(tmp, "model"))
        ddp = run_distributed(2, _sft, False, model_dir, os.path.join(tmp, "ddp"), steps=4,
                              timeout=TIMEOUT, **flags)[0]
        ours = run_distributed(2, _sft, True, model_dir, os.path.join(tmp, "ours"), steps=4,
                               timeout=TIMEOUT, **flags)[0]
    assert ours["steps"] == ddp["steps"] == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(ours["losses"])))
    torch.testing.assert_close(ours["losses"], ddp["losses"], rtol=2e-2, atol=0)
    assert ours["dtypes"] == ["torch.float32"]  # the shards (the optimizer's copy) stay fp32


def _refusals(model_dir, output_dir):
    """An annotated model with ``peft_config=`` under the mixin, and under the
    plain ``SFTTrainer`` (which accelerate wraps in DDP)."""
    reset_trainer_env()
    warnings.filterwarnings("ignore")
    model = build_llama()
    shard_layers_and_root(model)
    found = {}
    try:
        _trainer_class(True)(model=model, peft_config=_lora(), args=_config(output_dir, 1, bf16=False),
                             train_dataset=_data())
    except ValueError as e:
        found["peft_config"] = str(e)
    trainer = _trainer_class(False)(model=model, args=_config(output_dir, 1, bf16=False),
                                    train_dataset=_data(), processing_class=_tokenizer(model_dir))
    try:
        trainer.train()
    except TypeError as e:
        found["plain"] = str(e)
    return found


def _tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def test_sft_trainer_refusals_name_the_fix_on_every_rank():
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_llama_dir(os.path.join(tmp, "model"))
        for found in run_distributed(2, _refusals, model_dir, os.path.join(tmp, "out"),
                                     timeout=TIMEOUT):
            assert "peft_config" in found["peft_config"]
            assert "get_peft_model" in found["peft_config"]
            assert "ShardedTrainerMixin" in found["plain"]
            assert "DistributedDataParallel" in found["plain"]
