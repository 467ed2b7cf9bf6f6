"""The package files a backward runs through, pinned: two gloo ranks, a
GPT with its blocks and root annotated, after warm-up, recording every
fsdp_compose file whose code runs during ``loss.backward()`` (the
end-of-backward callback included: the engine runs it before
``backward()`` returns). ``docs/design.md`` §4 prints the same list
("A gradient's path"), so the page cannot drift from the code.

Run: ``.venv/bin/python -m pytest -q tests/runtime/test_backward_path.py``
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.harness import run_distributed

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"
MOST_FILES = 12
"""A backward at world size 2 runs through at most this many package files
(the count today; FSDP2's runs through about 5)."""


def files_a_backward_runs_through() -> list[str]:
    """The package files (relative to the package, sorted) whose functions
    run during one steady-state ``loss.backward()`` on this rank."""
    import fsdp_compose
    from fsdp_compose import fully_shard
    from fsdp_compose.testing import GPT, GPTConfig, synthetic_tokens

    package = os.path.dirname(fsdp_compose.__file__) + os.sep
    model_code = os.path.join(package, "testing") + os.sep
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=2))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = synthetic_tokens(dist.get_rank(), 2, 8, 64)
    for _ in range(4):  # lazy init, the verified iterations, optimizer state
        model.loss(tokens, targets).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    seen: set[str] = set()

    def profile(frame, event, _arg):
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(package) and not path.startswith(model_code):
                seen.add(path[len(package):].replace(os.sep, "/"))

    loss = model.loss(tokens, targets)
    sys.setprofile(profile)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
    return sorted(seen)


def printed_path() -> list[str]:
    """The files ``docs/design.md`` §4 lists after "files a backward runs through"."""
    text = DESIGN.read_text()
    match = re.search(r"<!-- backward-path -->(.*?)<!-- /backward-path -->", text, re.S)
    assert match, f"{DESIGN} lost its marked list of the backward's files"
    return sorted(re.findall(r"`fsdp_compose/([\w/]+\.py)`", match.group(1)))


def test_the_backward_runs_through_the_files_the_design_prints() -> None:
    ran = run_distributed(2, files_a_backward_runs_through, timeout=180)
    assert ran[0] == ran[1], ran
    assert len(ran[0]) <= MOST_FILES, (
        f"a backward runs through {len(ran[0])} package files, more than {MOST_FILES}: {ran[0]}")
    assert ran[0] == printed_path(), (
        f"docs/design.md §4 lists {printed_path()}, a backward runs through {ran[0]}")
