"""A model the user drops is freed by one garbage collection.

A model annotated by ``fully_shard`` is a reference cycle (module -> state
-> unit -> module), so only the garbage collector frees it; what the
library keeps across models (process-wide caches keyed by optimizer,
parameter or mesh) must never hold it, or ``del model; gc.collect()`` (a
sweep over models, a notebook, freeing memory before the next job) leaves
its parameters, gradients and optimizer state in memory. Checked with the
garbage collector off (no automatic collection hides a second pass), on
one and two ranks, and for the first model of a fresh interpreter (whose
first ``zero_grad`` imports ``torch._dynamo`` mid-step: see the last test).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._models import tiny_gpt
from tests.harness import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _train_and_drop(mode: str, checkpoint_root: str) -> tuple:
    """Weak references to a model trained two steps (AdamW, ``zero_grad``)
    inside this function, and to its optimizer, once both are dropped.
    ``mode``: ``"plain"``; ``"step"``, also clipping, the step, torch's
    state dicts and a flat checkpoint saved and loaded under
    ``checkpoint_root``; ``"frozen"``, the step with the embeddings and each
    block's first norm frozen (frozen buffers: a block's forward hooks its
    inputs' gradients to reshard them)."""
    import weakref

    import torch
    import torch.distributed as dist

    from fsdp_compose import fully_shard
    from fsdp_compose.testing import synthetic_tokens

    model = tiny_gpt(sharded=mode != "frozen")
    if mode == "frozen":
        model.tok_emb.weight.requires_grad_(False)
        model.pos_emb.weight.requires_grad_(False)
        for block in model.blocks:
            block.ln1.requires_grad_(False)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    tokens, targets = synthetic_tokens(dist.get_rank(), 2, 8, 32)
    for _ in range(2):
        loss = model.loss(tokens, targets)  # held through the next step, as a training loop does
        loss.backward()
        if mode == "step":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if mode != "plain":
            optimizer.step()
        optimizer.zero_grad()
    if mode == "step":
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from fsdp_compose.checkpoint import CheckpointStore, flat_state_dict
        get_state_dict(model, optimizer)
        store = CheckpointStore(checkpoint_root, keep=1)
        model_state, optimizer_state = flat_state_dict(model, optimizer)
        store.save(1, {"model": model_state, "optim": optimizer_state})
        model_state, optimizer_state = flat_state_dict(model, optimizer)
        store.load_latest({"model": model_state, "optim": optimizer_state})
    return weakref.ref(model), weakref.ref(model.blocks[0]), weakref.ref(optimizer)


def dropped_after_one_collection(mode: str, checkpoint_root: str) -> tuple[bool, bool, bool]:
    import gc

    enabled = gc.isenabled()
    gc.disable()
    try:
        gc.collect()  # whatever earlier tests left
        refs = _train_and_drop(mode, checkpoint_root)
        gc.collect()
        return tuple(ref() is None for ref in refs)
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("mode", ["plain", "step", "frozen"])
def test_a_dropped_model_is_freed_by_one_collection(world_size: int, mode: str,
                                                    tmp_path: Path) -> None:
    for rank, freed in enumerate(run_distributed(world_size, dropped_after_one_collection,
                                                 mode, str(tmp_path / "ckpt"))):
        assert freed == (True, True, True), (
            f"rank {rank}: after one gc.collect(), model / block / optimizer freed: {freed}")


def first_model_of_this_process(mode: str) -> tuple[bool, bool, bool]:
    """``dropped_after_one_collection`` in a process that has built no model
    yet, on its own gloo group of one rank."""
    import os
    import sys
    import tempfile

    import torch.distributed as dist

    assert "torch._dynamo" not in sys.modules  # imported by the first zero_grad: the case checked
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "store"),
                                rank=0, world_size=1)
        try:
            return dropped_after_one_collection(mode, os.path.join(tmp, "ckpt"))
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["plain", "frozen"])
def test_the_first_model_of_a_process_is_freed_by_one_collection(mode: str) -> None:
    """The first ``zero_grad`` of a process imports ``torch._dynamo``
    (torch's and the library's ``zero_grad`` are ``torch._disable_dynamo``
    wrappers); done while the step's graph is alive, a hook that holds the
    model strongly from autograd's C++ side then keeps it through a
    collection (plain torch does the same). The harness's processes have
    imported it long before (its fork server does), hence a new interpreter."""
    code = ("import json, sys; from tests.core.test_model_lifetime import "
            "first_model_of_this_process as first; print(json.dumps(first(sys.argv[1])))")
    result = subprocess.run([sys.executable, "-c", code, mode], cwd=ROOT, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    freed = tuple(json.loads(result.stdout.strip().splitlines()[-1]))
    assert freed == (True, True, True), (
        f"after one gc.collect(), model / block / optimizer freed: {freed}")
