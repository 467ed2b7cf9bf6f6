"""Where GPU memory is held: live CUDA allocations grouped by the line that
made them, after each phase (forward, backward, optimizer) of one step, for
fsdp_compose and torch FSDP2 side by side (world size 1, NCCL, bf16 compute).

    python -m benchmarks.gpu.memory_sites                     # many-small, step 3
    python -m benchmarks.gpu.memory_sites --config gpt-782m --step 1

Uses ``torch.cuda.memory._record_memory_history`` (a stack per allocation)
and ``torch.cuda.memory._snapshot``; each block is charged to the innermost
frame in fsdp_compose, torch's optimizers or FSDP2. Block sizes are what the
caching allocator handed out (``max_memory_allocated`` counts them), which
can exceed the size requested.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import tempfile

import torch
import torch.distributed as dist

from benchmarks.gpu.step import CONFIGS, _build
from fsdp_compose.testing import synthetic_tokens

MiB = 2 ** 20
OURS = ("fsdp_compose", "torch/optim", "torch/distributed/fsdp")


def _site(frames: list[dict]) -> str:
    mine = [f for f in frames if any(part in f["filename"] for part in OURS)]
    frame = mine[0] if mine else (frames[0] if frames else {"filename": "?", "line": 0,
                                                            "name": "?"})
    return f'{frame["filename"].split("site-packages/")[-1][-60:]}:{frame["line"]}:{frame["name"]}'


def live_by_site() -> collections.Counter:
    """Bytes of live CUDA blocks per allocation site."""
    torch.cuda.synchronize()
    out: collections.Counter = collections.Counter()
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                out[_site(block.get("frames", []))] += block["size"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="many-small", choices=sorted(CONFIGS))
    parser.add_argument("--step", type=int, default=3)
    parser.add_argument("--top", type=int, default=8)
    options = parser.parse_args()
    cfg, batch = CONFIGS[options.config]
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'rdzv')}",
                                rank=0, world_size=1)
        x, y = (t.to(device) for t in synthetic_tokens(0, batch, cfg.seq_len, cfg.vocab_size))
        seen = {}
        for variant in ("fsdp_compose", "fsdp2"):
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.memory._record_memory_history(max_entries=200_000)
            model, optim, loss_fn = _build(variant, cfg, device, True)
            for step in range(1, options.step + 1):
                loss = loss_fn(x, y)
                if step == options.step:
                    seen[variant, "forward"] = live_by_site()
                loss.backward()
                if step == options.step:
                    seen[variant, "backward"] = live_by_site()
                optim.step()
                optim.zero_grad(set_to_none=True)
                if step == options.step:
                    seen[variant, "optimizer"] = live_by_site()
            torch.cuda.memory._record_memory_history(enabled=None)
            del model, optim, loss_fn, loss
        for phase in ("forward", "backward", "optimizer"):
            ours, theirs = seen["fsdp_compose", phase], seen["fsdp2", phase]
            print(f"== after the {phase} of step {options.step}: fsdp_compose "
                  f"{sum(ours.values()) / MiB:.1f} MiB, FSDP2 {sum(theirs.values()) / MiB:.1f} MiB")
            for name, sites in (("fsdp_compose", ours), ("FSDP2", theirs)):
                print(f"  {name}:")
                for where, size in sites.most_common(options.top):
                    print(f"    {size / MiB:9.1f} MiB  {where}")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
