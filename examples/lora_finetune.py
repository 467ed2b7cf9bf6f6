"""LoRA fine-tuning of a Hugging Face Llama with PEFT and fsdp_compose.

    # two CPU ranks on this machine, about a minute (what `make lora-demo` runs)
    torchrun --standalone --nproc-per-node 2 examples/lora_finetune.py
    # a bigger model on one node with GPUs (NCCL is picked when CUDA is available)
    torchrun --standalone --nproc-per-node 8 examples/lora_finetune.py --layers 16 --hidden 1024
    # keep the trained adapter (PEFT format: adapter_config.json + weights)
    torchrun --standalone --nproc-per-node 2 examples/lora_finetune.py --save-adapter /tmp/adapter

Needs the `hf` extra (`pip install -e '.[hf]'`: transformers, peft, tqdm).
Nothing is downloaded: the "pretrained" model is a LlamaForCausalLM built from
a small LlamaConfig with random weights (same seed on every rank), which
stands in for `LlamaForCausalLM.from_pretrained(...)`.

What it shows:
  * peft.get_peft_model adds LoRA adapters to q_proj/v_proj and freezes the rest;
  * fully_shard on every decoder layer, then on the root: the frozen base
    weights are sharded and all-gathered for compute, but get no gradient
    memory and no reduce-scatter traffic; only the adapters are reduced;
  * a plain torch.optim.AdamW over the trainable (adapter) parameters;
  * register_forward_method(model, "generate") so that PeftModel.generate,
    which never calls PeftModel.forward, sees full parameters;
  * with --save-adapter DIR, get_model_state_dict(model, options=StateDictOptions(
    full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)) on every
    rank gathers the adapter weights only, in their original shapes, onto rank 0's
    CPU, and rank 0 writes them with save_pretrained (PEFT's format).
Losses shown by rank 0's progress bar are the mean over all ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

# Nothing here comes from the Hugging Face hub (drop this line when you load
# real weights with from_pretrained).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from fsdp_compose import fully_shard, param_info, register_forward_method  # noqa: E402
from fsdp_compose.testing import init_from_torchrun, synthetic_tokens  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save-adapter", metavar="DIR", default=None,
                        help="write the trained adapter there (from rank 0)")
    return parser.parse_args()


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 8 // 3 // 8 * 8,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 32),
                         num_key_value_heads=max(1, args.hidden // 64),
                         max_position_embeddings=max(256, args.seq * 2), use_cache=False,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)  # every rank builds the same "pretrained" weights
    base = LlamaForCausalLM(config).to(device)
    lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                      target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return get_peft_model(base, lora)  # same seed: same adapter initialisation everywhere


def main() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # peft calls deprecated transformers APIs
    args = parse_args()
    device = init_from_torchrun()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args, device)

    # Shard: every decoder layer is a unit, the root takes the rest (embeddings,
    # final norm, head). Names and parameter objects do not change.
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    register_forward_method(model, "generate")

    trainable = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    if rank == 0:
        total = sum(param_info(p).numel for p in model.parameters())
        adapters = sum(param_info(p).numel for p in trainable)
        print(f"{world} ranks on {device}: {total / 1e6:.2f}M parameters, {adapters / 1e3:.1f}K "
              f"trainable ({100 * adapters / total:.2f}%); gradients reduce-scattered per step: "
              f"{adapters * 4 / 1024:.1f} KiB (adapters only) instead of {total * 4 / 1024:.1f} KiB")

    per = args.batch_per_rank
    model.train()
    bar = tqdm(range(args.steps), disable=rank != 0, desc="LoRA", unit="step")
    for step in bar:
        x, y = synthetic_tokens(step, per * world, args.seq, args.vocab)
        ids = x[rank * per:(rank + 1) * per].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()

    model.eval()
    prompt = synthetic_tokens(10_000, 1, 12, args.vocab)[0].to(device)
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=10, do_sample=False)
    if rank == 0:
        print("prompt   ", prompt[0].tolist())
        print("generated", out[0, prompt.shape[1]:].tolist())

    if args.save_adapter:
        # Collective (every rank): the trainable parameters only, gathered in
        # their original shapes onto rank 0's CPU; the frozen base model is
        # never communicated.
        adapter = get_model_state_dict(model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
        if rank == 0:
            model.save_pretrained(args.save_adapter, state_dict=adapter)
            print(f"adapter saved to {args.save_adapter}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Skip interpreter teardown (see examples/train_gpt.py): gloo can abort
    # while a still-referenced process group is finalised.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
