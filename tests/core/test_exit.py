"""A script that ends with ``destroy_process_group()`` exits with gloo's
threads already joined ([Note: process groups at exit] in
``fsdp_compose/comm/groups.py``).

Run: ``.venv/bin/python -m pytest -q tests/core/test_exit.py``

Before, the meshes of a live model's units kept the destroyed groups (and
the last step's finished all-gather kept the default one), so gloo's
threads lived into interpreter finalization, where the process now and
then aborted ("terminate called without an active exception": the README's
script, once in a suite run under a CPU hog). The check is deterministic:
an exit handler registered before fsdp_compose is imported runs after the
library's, and counts the process's threads there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._torchrun_env import run_like_torchrun

SCRIPT = r'''
import atexit, os

def record(moment):
    with open(f"threads_{os.environ['RANK']}.txt", "a") as f:
        f.write(f"{moment}={len(os.listdir('/proc/self/task'))}\n")

def threads_at_exit():
    record("at exit")

atexit.register(threads_at_exit)  # before fsdp_compose's: runs after it

import torch
import torch.distributed as dist
from fsdp_compose import fully_shard
from fsdp_compose.testing import GPT, GPTConfig, init_from_torchrun, synthetic_tokens

init_from_torchrun()
torch.set_num_threads(1)  # no intra-op pool: the main thread and gloo's only
torch.manual_seed(0)
model = GPT(GPTConfig(n_layers=2))
for block in model.blocks:
    fully_shard(block)
fully_shard(model)
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
rank = dist.get_rank()
for step in range(2):
    tokens, targets = synthetic_tokens(step, batch=4, seq_len=16, vocab_size=97)
    model.loss(tokens[2 * rank:2 * rank + 2], targets[2 * rank:2 * rank + 2]).backward()
    optim.step()
    optim.zero_grad()
record("before destroy")
{ending}
'''


def _run(tmp_path: Path, ending: str) -> dict[str, dict[str, int]]:
    """Per rank, the process's thread count before ``ending`` and at exit."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("{ending}", ending))
    # new interpreters (their exit is what is checked), as torchrun starts them
    proc = run_like_torchrun(2, script.name, cwd=tmp_path, timeout=180, fresh_interpreters=True)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    counts = {}
    for rank in ("0", "1"):
        lines = (tmp_path / f"threads_{rank}.txt").read_text().splitlines()
        counts[rank] = {moment: int(n) for moment, _, n in (line.partition("=") for line in lines)}
    return counts


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_gloo_threads_are_joined_before_interpreter_finalization(tmp_path: Path):
    counts = _run(tmp_path, "dist.destroy_process_group()")
    for rank, seen in counts.items():
        assert seen["before destroy"] > 1, (rank, seen)  # gloo's threads ran (the check can fail)
        assert seen["at exit"] == 1, (rank, seen)  # only the main thread is left
