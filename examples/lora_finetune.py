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
  * get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
    cpu_offload=True, ignore_frozen_params=True)) on every rank gathers the
    adapter weights only, in their original shapes, onto rank 0's CPU (without
    communicating the frozen base model); rank 0 then checks the sharded
    model's greedy generation against an unsharded copy with the same
    weights, and can save the adapter (--save-adapter DIR, PEFT's format).
Losses shown by rank 0's progress (a bar on a terminal, a line every tenth of
the steps in a file or pipe; examples/_progress.py) are the mean over all
ranks. At the end rank 0 prints the loss at the first and last steps and
what the generation check found, e.g.

    loss (mean over ranks): 6.204 at step 1 -> 1.757 at step 120 (1.755 over the last 10 steps)
      (a uniform guess over the 512 tokens scores ln 512 = 6.238)
    greedy generation, 10 new tokens after a 12-token prompt (token ids):
      prompt                     172 47 295 192 323 172 47 117 192 323 172 135
      generated (sharded model)  117 192 323 172 47 117 192 323 172 47
      data pattern (no noise)    117 192 323 172 47 117 192 323 172 47
    continues the training data's 5-token pattern: 10 of 10 tokens
    matches the unsharded model's greedy output (same weights, one process): yes

and exits with status 1 if the sharded and unsharded outputs differ.
"""

from __future__ import annotations

import argparse
import math
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
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from _progress import Progress  # noqa: E402  (examples/_progress.py, next to this file)
from fsdp_compose import fully_shard, param_info, register_forward_method  # noqa: E402
from fsdp_compose.testing import init_from_torchrun, synthetic_tokens  # noqa: E402

PROMPT_TOKENS, NEW_TOKENS = 12, 10


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
        print(f"{world} rank{'s' if world > 1 else ''} on {device}: {total / 1e6:.2f}M parameters, "
              f"{adapters / 1e3:.1f}K trainable ({100 * adapters / total:.2f}%); gradients "
              f"reduce-scattered per step: {adapters * 4 / 1024:.1f} KiB (adapters only) "
              f"instead of {total * 4 / 1024:.1f} KiB")

    per = args.batch_per_rank
    model.train()
    progress = Progress(args.steps, desc="LoRA", file=sys.stderr) if rank == 0 else None
    losses: list[float] = []  # per step, the mean over ranks
    for step in range(args.steps):
        x, y = synthetic_tokens(step, per * world, args.seq, args.vocab)
        ids = x[rank * per:(rank + 1) * per].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
        if progress is not None:
            progress.step(f"loss {losses[-1]:.3f}")
    if progress is not None:
        progress.close()

    # Greedy generation on every rank (generate is a collective: it all-gathers
    # each unit, thanks to register_forward_method).
    model.eval()
    prompt = synthetic_tokens(10_000, 1, PROMPT_TOKENS, args.vocab)[0].to(device)
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=NEW_TOKENS, do_sample=False)
    generated = out[0, PROMPT_TOKENS:].tolist()

    # Collective (every rank): the trainable parameters only, gathered in
    # their original shapes onto rank 0's CPU; the frozen base model is
    # never communicated.
    adapter = get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
    same = True
    if rank == 0:
        # The same frozen base (same seed) plus the trained adapter, in one
        # process without fully_shard: its greedy tokens must be the same.
        reference = build_model(args, device)
        missing, unexpected = reference.load_state_dict(adapter, strict=False)
        assert not unexpected and all("lora_" not in k for k in missing), (missing, unexpected)
        reference.eval()
        with torch.no_grad():
            want = reference.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                      max_new_tokens=NEW_TOKENS, do_sample=False)
        want = want[0, PROMPT_TOKENS:].tolist()
        same = generated == want
        # The data repeats a 5-token pattern with 5% of the tokens replaced;
        # noise=0 gives the same rows without the replacements.
        clean = synthetic_tokens(10_000, 1, PROMPT_TOKENS + NEW_TOKENS, args.vocab,
                                 noise=0.0)[0][0, PROMPT_TOKENS:].tolist()
        print(generation_report(losses, args.vocab, prompt[0].tolist(), generated, clean, want))
        if not same:
            print("the sharded model generated other tokens than the same weights unsharded: "
                  "a bug in fsdp_compose (please report it)", file=sys.stderr)

    if args.save_adapter and rank == 0:
        model.save_pretrained(args.save_adapter, state_dict=adapter)
        print(f"adapter saved to {args.save_adapter}")
    dist.destroy_process_group()
    if not same:
        sys.stdout.flush()
        os._exit(1)


def generation_report(losses: list[float], vocab: int, prompt: list[int], generated: list[int],
                      clean: list[int], unsharded: list[int]) -> str:
    """What rank 0 prints at the end: the first and last losses (and what a
    model that learnt nothing scores), the token ids of the prompt, of the
    sharded model's greedy continuation and of the data's noise-free
    continuation, then how many tokens follow the pattern and whether the
    unsharded model generated the same."""
    def ids(tokens: list[int]) -> str:
        return " ".join(map(str, tokens))

    tail = losses[-10:]
    rows = [("prompt", prompt), ("generated (sharded model)", generated), ("data pattern (no noise)", clean)]
    width = max(len(name) for name, _ in rows)
    hits = sum(g == c for g, c in zip(generated, clean))
    return "\n".join([
        (f"loss (mean over ranks): {losses[0]:.3f} at step 1 -> {losses[-1]:.3f} at step "
         f"{len(losses)} ({sum(tail) / len(tail):.3f} over the last {len(tail)} steps)"),
        f"  (a uniform guess over the {vocab} tokens scores ln {vocab} = {math.log(vocab):.3f})",
        (f"greedy generation, {len(generated)} new tokens after a {len(prompt)}-token prompt "
         f"(token ids):"),
        *(f"  {name.ljust(width)}  {ids(tokens)}" for name, tokens in rows),
        f"continues the training data's 5-token pattern: {hits} of {len(clean)} tokens",
        "matches the unsharded model's greedy output (same weights, one process): "
        + ("yes" if generated == unsharded else f"no (unsharded: {ids(unsharded)})"),
    ])


if __name__ == "__main__":
    main()
    # Skip interpreter teardown (see examples/train_gpt.py): gloo can abort
    # while a still-referenced process group is finalised.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
