"""Tiny Hugging Face models (random weights, no hub access) and the training
loops the Hugging Face / PEFT / composition tests share.

Every model is built from a small config with a fixed seed, so each rank and
the single-process reference start from the same weights. Sizes are uneven
(vocabulary 101, hidden 40) so that flat buffers need padding on 3 ranks.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compose import ShardedModule, fully_shard
from fsdp_compose.testing import synthetic_tokens
from tests._training import make_optimizer

# Models are built from configs: the hub must never be contacted (set before
# transformers is imported: it reads the variable once).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 101
SEQ = 12
BATCH_PER_RANK = 2
LLAMA_KW = dict(vocab_size=VOCAB, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def llama_config(tie: bool = False, **overrides):
    from transformers import LlamaConfig
    return LlamaConfig(**{**LLAMA_KW, "tie_word_embeddings": tie, **overrides})


def build_llama(tie: bool = False, lora: bool = False, **overrides) -> nn.Module:
    """A 2-layer ``LlamaForCausalLM`` with random weights (same on every
    rank); with ``lora``, wrapped by ``peft.get_peft_model`` with LoRA on
    ``q_proj``/``v_proj`` (both adapter matrices random, so every adapter
    weight gets a gradient from the first step)."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(1234)
    model = LlamaForCausalLM(llama_config(tie, **overrides))
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    return [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]


def shard_layers_and_root(model: nn.Module, **kw) -> None:
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    fully_shard(model)


def batch(step: int, world: int) -> torch.Tensor:
    """The global batch of token ids for ``step`` (labels are the inputs:
    Hugging Face shifts them itself)."""
    x, _ = synthetic_tokens(step, world * BATCH_PER_RANK, SEQ, VOCAB, seed=11)
    return x


def local(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per:(rank + 1) * per]


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value under its original FQN, read through
    ``unshard()`` of every annotated module (works on every rank)."""
    names = [n for n, _ in model.named_parameters()]
    annotated = [m for m in model.modules() if isinstance(m, ShardedModule)]
    for m in annotated:  # the model itself may not be annotated (e.g. replicate at the root)
        m.unshard()
    try:
        return {n: attr(model, n).detach().clone() for n in names}
    finally:
        for m in annotated:
            m.reshard()


def attr(model: nn.Module, fqn: str) -> torch.Tensor:
    owner, _, name = fqn.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, name)


def train_sharded(build: Callable[[], nn.Module], annotate: Callable[[nn.Module], None],
                  optim_name: str = "sgd", steps: int = 3,
                  step_hook: Optional[Callable[[nn.Module, int], None]] = None) -> dict:
    """Runs on every rank: annotate, train ``steps`` steps on this rank's
    slice of the global batch. Returns the global mean losses, the full
    parameters after training and whether the names/objects were kept."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build()
    before = dict(model.named_parameters())
    annotate(model)
    after = dict(model.named_parameters())
    same_names = list(after) == list(before) and all(after[n] is before[n] for n in before)
    optim = make_optimizer(model, optim_name)
    losses = []
    for step in range(steps):
        loss = lm_loss(model, local(batch(step, world), rank, world))
        loss.backward()
        if step_hook is not None:
            step_hook(model, step)
        optim.step()
        optim.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return {"losses": losses, "params": full_params(model), "same_names": same_names,
            "model": model}


def train_reference(build: Callable[[], nn.Module], world: int, optim_name: str = "sgd",
                    steps: int = 3) -> dict:
    """The same training in one process on the global batch."""
    model = build()
    optim = make_optimizer(model, optim_name)
    losses = []
    for step in range(steps):
        loss = lm_loss(model, batch(step, world))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "model": model}


def max_diff(result: dict, reference: dict) -> float:
    """Largest difference in losses and parameters; asserts the names match."""
    assert result["params"].keys() == reference["params"].keys()
    worst = max(abs(a - b) for a, b in zip(result["losses"], reference["losses"]))
    for name, want in reference["params"].items():
        got = result["params"][name]
        assert got.shape == want.shape, f"{name}: {tuple(got.shape)} vs {tuple(want.shape)}"
        worst = max(worst, (got - want).abs().max().item())
    return worst


# ------------------------------------------------------------- measuring
class SavedActivations:
    """Context manager: bytes of the tensors autograd saves for backward
    while active (distinct storages), leaving out tensors in the flat buffers' unsharded storage
    (parameters: they are freed by resharding, not by checkpointing).
    Tensors saved inside a non-reentrant checkpoint region go to the
    checkpoint's own hooks (the innermost win) and are therefore not counted:
    exactly the memory checkpointing saves."""

    def __init__(self, flat_bases) -> None:
        self.flat_bases = list(flat_bases)
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        # a parameter reads its unit's unsharded storage (which holds memory now)
        if storage.data_ptr() not in {f.untyped_storage().data_ptr() for f in self.flat_bases}:
            self.storages.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def save_llama_dir(directory: str, tie: bool = False) -> str:
    """``build_llama``'s model and a word-level tokenizer over its
    vocabulary (``<pad>``, ``<s>``, ``</s>``, ``t3`` ... ``t100``), written
    with ``save_pretrained`` into ``directory``: a model path that
    ``from_pretrained`` / ``AutoTokenizer`` read offline. Returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<pad>")
    build_llama(tie).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def reset_trainer_env(cuda: bool = False) -> None:
    """In a worker process, before building a Hugging Face trainer: the
    environment torchrun would set, accelerate's process-wide state and
    variables from an earlier trainer in the same process cleared."""
    from accelerate.state import AcceleratorState
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(LOCAL_RANK="0" if cuda else str(rank), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS=str(torch.get_num_threads()),
                      HF_HUB_OFFLINE="1")
    for name in [n for n in os.environ if n.startswith(("ACCELERATE_", "FSDP_"))]:
        del os.environ[name]  # what an FSDP2 run before (same worker process) left set
    AcceleratorState._reset_state(reset_partial_state=True)


def trained_adapter(directory: str) -> dict[str, torch.Tensor]:
    """The LoRA weights ``PeftModel.from_pretrained`` reads from
    ``directory`` into a fresh ``build_llama()``, in this (one) process."""
    from peft import PeftModel
    model = PeftModel.from_pretrained(build_llama(), directory)
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
