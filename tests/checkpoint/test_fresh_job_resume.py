"""Every checkpoint recipe of docs/checkpointing.md resumes exactly in a
FRESH job: a second process group of new processes, whose optimizer has
never stepped, continues the uninterrupted run's losses bit for bit; the
start-up recipe without ``register_optimizer`` (which would leave a fresh
AdamW's state empty, silently) raises on every rank naming the optimizer's
state dict and both fixes, which run here.

A first job trains 2 steps, saves with every recipe, trains 2 more
(the uninterrupted losses) and destroys its process group, so the harness
replaces its workers; each resume then runs in new processes.

Run: ``PYTHONPATH=. python -m pytest -q tests/checkpoint/test_fresh_job_resume.py``
(gloo on CPU, 2 ranks; about a minute: one worker start per job).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed

WORLD = 2
SAVED_AT, STEPS = 2, 4
RECIPES = ("dcp", "flat", "async_store", "store", "register_then_dcp")
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
}


def _build(optimizer: str):
    from fsdp_compose import fully_shard
    from fsdp_compose.testing import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, OPTIMIZERS[optimizer](model.parameters())


def _step(model, optim, i: int) -> float:
    from fsdp_compose.testing import synthetic_tokens
    tokens, targets = synthetic_tokens(dist.get_rank() + 10 * i, batch=2, seq_len=16,
                                       vocab_size=97)
    loss = model.loss(tokens, targets)
    loss.backward()
    optim.step()
    optim.zero_grad()
    every = [torch.zeros(()) for _ in range(WORLD)]
    dist.all_gather(every, loss.detach())
    return sum(t.item() for t in every)


def _save(recipe: str, model, optim, root: str) -> None:
    """Each recipe's save, as the page writes it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from fsdp_compose.checkpoint import CheckpointStore, FlatSavePlanner, flat_state_dict
    if recipe == "dcp":
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/dcp")
    elif recipe == "flat":
        model_sd, optim_sd = flat_state_dict(model, optim)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/flat",
                 planner=FlatSavePlanner())
    elif recipe == "async_store":
        store = CheckpointStore(f"{root}/async", keep=2, async_save=True)
        model_sd, optim_sd = flat_state_dict(model, optim)
        store.save(SAVED_AT, {"model": model_sd, "optim": optim_sd})
        store.wait()
    elif recipe == "store":
        store = CheckpointStore(f"{root}/store", keep=2)
        store.save(SAVED_AT, {"model": model.state_dict(), "optim": optim.state_dict()})
    elif recipe == "register_then_dcp":
        dcp.save({"model": model.state_dict(), "optim": optim.state_dict()},
                 checkpoint_id=f"{root}/plain")


def _resume(recipe: str, model, optim, root: str) -> None:
    """Each recipe's start-up, as the page writes it (model and optimizer just built)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from fsdp_compose.checkpoint import (CheckpointStore, FlatLoadPlanner, flat_state_dict,
                                         register_optimizer)
    if recipe == "dcp":
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/dcp")
        set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
    elif recipe == "flat":
        model_sd, optim_sd = flat_state_dict(model, optim)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/flat",
                 planner=FlatLoadPlanner())
        set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
    elif recipe == "async_store":
        store = CheckpointStore(f"{root}/async", keep=2, async_save=True)
        model_sd, optim_sd = flat_state_dict(model, optim)
        assert store.load_latest({"model": model_sd, "optim": optim_sd}) == SAVED_AT
        set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
    elif recipe == "store":  # "Crash-safe checkpoint directories", the start-up recipe
        store = CheckpointStore(f"{root}/store", keep=2)
        register_optimizer(optim)
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        step = store.load_latest(state)
        assert step == SAVED_AT
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
    elif recipe == "register_then_dcp":  # the Optimizers bullet: register, then load_state_dict
        register_optimizer(optim)
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        dcp.load(state, checkpoint_id=f"{root}/plain")
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])


def _first_job(optimizer: str, root: str) -> list[float]:
    model, optim = _build(optimizer)
    losses = [_step(model, optim, i) for i in range(SAVED_AT)]
    for recipe in RECIPES:
        _save(recipe, model, optim, root)
    losses += [_step(model, optim, i) for i in range(SAVED_AT, STEPS)]
    dist.destroy_process_group()  # the job ends: the harness starts new workers
    return losses


def _fresh_job(optimizer: str, root: str) -> dict:
    """In new processes: the bare start-up recipe first (the process's first
    model), then each recipe on a model and optimizer just built."""
    out = {"bare": _bare_recipe(optimizer, root)}
    for recipe in RECIPES:
        model, optim = _build(optimizer)
        _resume(recipe, model, optim, root)
        entries = len(optim.state)
        out[recipe] = {"losses": [_step(model, optim, i) for i in range(SAVED_AT, STEPS)],
                       "state_entries": entries}
    dist.destroy_process_group()
    return out


def _bare_recipe(optimizer: str, root: str) -> str:
    """The start-up recipe without register_optimizer: the optimizer's state dict is empty."""
    from fsdp_compose.checkpoint import CheckpointError, CheckpointStore
    model, optim = _build(optimizer)
    store = CheckpointStore(f"{root}/store", keep=2)
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    try:
        store.load_latest(state)
    except CheckpointError as error:
        return str(error)
    return "nothing raised"


@pytest.fixture(scope="module", params=sorted(OPTIMIZERS))
def resumed(request, tmp_path_factory):
    """(optimizer, uninterrupted losses, the fresh job's results by rank)."""
    root = str(tmp_path_factory.mktemp(f"ckpt-{request.param}"))
    losses = run_distributed(WORLD, _first_job, request.param, root, timeout=240)[0]
    return request.param, losses, run_distributed(WORLD, _fresh_job, request.param, root,
                                                  timeout=240)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_resumes_exactly_in_a_fresh_job(resumed, recipe):
    optimizer, uninterrupted, results = resumed
    for rank, by_recipe in enumerate(results):
        out = by_recipe[recipe]
        assert out["state_entries"] > 0, f"rank {rank}: {recipe} left the optimizer without state"
        assert out["losses"] == uninterrupted[SAVED_AT:], (
            f"rank {rank}: {recipe} ({optimizer}) resumed with losses {out['losses']}, the "
            f"uninterrupted run had {uninterrupted[SAVED_AT:]}")


def test_bare_start_up_recipe_raises_on_every_rank_naming_the_fix(resumed):
    for rank, by_recipe in enumerate(resumed[2]):
        message = by_recipe["bare"]
        assert "state['optim']" in message, f"rank {rank}: {message}"
        assert "never stepped" in message and "register_optimizer(optim)" in message, message
        assert "get_state_dict(model, optim)" in message, f"rank {rank}: {message}"
