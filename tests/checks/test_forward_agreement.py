"""Every root forward starts with an agreement through the rendezvous store
([Note: forward agreement] in ``fsdp_compose/checks/forward_agreement.py``): an
evaluation forward on one rank only, at any step, ends in the library's
message on every rank before anything is communicated, instead of gloo
aborting the process that receives a collective of another size.

Run: ``PYTHONPATH=. python -m pytest -q tests/checks/test_forward_agreement.py``
(gloo on CPU, 2 ranks; ``-m slow`` adds the step-100 case and a torchrun job).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compose.comm.wire import STALL_ENV
from tests._training import assert_diverged_on_every_rank, shard_on_a_new_group
from tests.harness import run_distributed

STALL = 3


class Unequal(nn.Module):
    """Units of different sizes (a mismatched pairing would abort gloo)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 24)
        self.blocks = nn.ModuleList([nn.Linear(24, 24), nn.Linear(24, 40), nn.Linear(40, 24)])
        self.head = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor, skip: int = -1) -> torch.Tensor:
        x = self.embed(x)
        for index, block in enumerate(self.blocks):
            if index != skip:
                x = torch.tanh(block(x))
        return self.head(x)


def train_with_odd_rank(steps: int, at_step: int, what: str, bucket_cap_mb: float = 4.0):
    """Every rank trains ``steps`` steps; at ``at_step`` rank 0 first runs
    an evaluation forward (``eval``: under ``no_grad``; ``eval-grad``: a
    forward with gradients and no backward), sleeps (``slow``), or skips
    ``blocks[0]`` in its training forward (``skip``), or puts ``blocks[1]``
    in eval mode (``unit-eval``); with ``train-one`` / ``train-all`` every
    rank evaluates in eval mode, then rank 0 / every rank calls
    ``model.train()``. Returns
    (step, seconds into the step, message) of the error, or None."""
    os.environ[STALL_ENV] = str(STALL)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Unequal()
    group = shard_on_a_new_group(model, 50, bucket_cap_mb)  # pending collectives die with it
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        for step in range(steps):
            start = time.perf_counter()
            try:
                if rank == 0 and step == at_step:
                    if what == "eval":
                        with torch.no_grad():
                            model(torch.randn(4, 8))
                    elif what == "eval-grad":
                        model(torch.randn(4, 8))
                    elif what == "slow":
                        time.sleep(2 * STALL + 1)
                    elif what == "unit-eval":
                        model.blocks[1].eval()
                if step == at_step and what in ("train-one", "train-all"):
                    model.eval()  # an evaluation on every rank
                    with torch.no_grad():
                        model(torch.randn(4, 8))
                    if rank == 0 or what == "train-all":
                        model.train()  # "train-one": rank 1 forgets it
                skip = 0 if what == "skip" and rank == 0 and step == at_step else -1
                model(torch.randn(4, 8), skip).sum().backward()
            except RuntimeError as error:
                return step, time.perf_counter() - start, str(error)
            optim.step()
            optim.zero_grad()
    finally:
        del os.environ[STALL_ENV]
    dist.destroy_process_group(group)
    return None


@pytest.mark.parametrize("bucket_cap_mb", [0.0, 4.0])
def test_an_evaluation_on_one_rank_at_step_3_is_named_on_every_rank(bucket_cap_mb):
    results = run_distributed(2, train_with_odd_rank, 6, 3, "eval", bucket_cap_mb, timeout=90)
    assert_diverged_on_every_rank(results, 3, "ranks [0] are starting a forward of the root without gradients",
           "ranks [1] start one with gradients", "nothing was communicated")


@pytest.mark.slow
def test_an_evaluation_on_one_rank_at_step_100_is_named_on_every_rank():
    results = run_distributed(2, train_with_odd_rank, 102, 100, "eval", timeout=200)
    assert_diverged_on_every_rank(results, 100, "ranks [0] are starting a forward of the root without gradients")


def test_a_forward_without_backward_on_one_rank_is_named_on_every_rank():
    """Rank 0's extra forward keeps gradients: rank 1 goes on to its
    backward, whose collectives rank 0 never issues. Rank 0 waits at its
    next forward's agreement, rank 1 in a collective; both stall and compare
    their flight logs."""
    results = run_distributed(2, train_with_odd_rank, 6, 3, "eval-grad", timeout=90)
    for rank, (step, seconds, message) in enumerate(results):
        assert step == 3 and seconds < 60, (rank, step, seconds, message)
        assert message.startswith(f"[rank {rank}] fully_shard ranks diverged"), message
        assert "rank 0 issued nothing more" in message, message


@pytest.mark.parametrize("bucket_cap_mb", [0.0, 4.0])
def test_a_unit_skipped_on_one_rank_at_step_5_is_named_on_every_rank(bucket_cap_mb):
    """Forward prefetch pairs the forward's all-gathers anyway; the
    backward's reduce-scatters would pair units of different sizes (gloo
    aborts). The ranks agree on the units each training forward ran before
    the backward communicates."""
    results = run_distributed(2, train_with_odd_rank, 8, 5, "skip", bucket_cap_mb, timeout=90)
    assert_diverged_on_every_rank(results, 5, "ran different units in root forward #6",
                                  "rank 0 ran [<root> (Unequal), 'blocks.1'",
                                  "rank 1 ran [<root> (Unequal), 'blocks.0'",
                                  "before the backward communicated anything")


def test_a_model_left_in_eval_mode_on_one_rank_is_named_on_every_rank():
    """Every rank evaluates (model.eval(), no_grad), only rank 0 calls
    model.train(): the next training forward raises on both ranks, before
    it computes anything, naming the rank in eval mode and the fix."""
    results = run_distributed(2, train_with_odd_rank, 6, 3, "train-one", timeout=90)
    assert_diverged_on_every_rank(results, 3, "at root forward #5, ranks [1] have the model in "
                                  "eval mode (model.eval()", "where ranks [0] have it in training "
                                  "mode", "nothing was computed yet",
                                  "Call model.train() on every rank")


def test_the_fix_model_train_on_every_rank_trains_on():
    assert run_distributed(2, train_with_odd_rank, 6, 3, "train-all", timeout=90) == [None, None]


def test_a_unit_in_eval_mode_on_one_rank_is_named_with_its_module():
    results = run_distributed(2, train_with_odd_rank, 6, 3, "unit-eval", timeout=90)
    assert_diverged_on_every_rank(results, 3, "modules 'blocks.1' (Linear) are in eval mode on "
                                  "some ranks only (in eval mode: rank 0: 'blocks.1' (Linear); "
                                  "rank 1: none)",
                                  "Call model.train() on every rank")


def test_a_slow_rank_at_the_agreement_is_not_divergence():
    assert run_distributed(2, train_with_odd_rank, 6, 3, "slow", timeout=90) == [None, None]


@pytest.mark.slow  # one torchrun job, ~20 s
def test_an_evaluation_on_one_rank_is_named_on_every_rank_under_torchrun(tmp_path: Path):
    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "odd_eval.py"
    script.write_text(
        "import os\n"
        "import torch.distributed as dist\n"
        "from tests.checks.test_forward_agreement import train_with_odd_rank\n"
        "dist.init_process_group('gloo')\n"
        "result = train_with_odd_rank(6, 3, 'eval')\n"
        # one write (< PIPE_BUF, atomic): print() writes the text and its newline
        # separately, and the other rank's line could land between them
        "os.write(1, f'RANK {dist.get_rank()} RESULT {result!r}\\n'.encode())\n")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(script)],
                          cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert re.search(rf"^RANK {rank} RESULT \(3, .*ranks \[0\] are starting a forward",
                         proc.stdout, re.MULTILINE), proc.stdout[-3000:]
