"""The sharded gradient kept across steps (``KeptGradient`` in buffers/flat_grad.py, [Note:
the kept sharded gradient]): made once and written into at every later
step, its memory given back by ``zero_grad(set_to_none=True)`` (the
optimizer's or the model's) or else at the next forward once the ``.grad``
were dropped; and never written
while anything the user holds still sees it (a Python reference, a detached
alias, a slice, a NumPy array, a ``.grad`` left in place). Parity of the
gradients with one process is ``tests/core/test_parity.py``'s; here, what
keeping may not change: the gradients are bitwise those of the same run
with nothing held."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from tests._models import tiny_gpt
from tests.harness import run_distributed

WARMUP = 2
STEPS = 3


def _gradients(model) -> list:
    from fsdp_compose.runtime.state import state_of

    return [buffer.grad for state in state_of(model).context.states for buffer in state.unit.buffers]


def _loss(model, seed: int) -> torch.Tensor:
    import torch.distributed as dist

    from fsdp_compose.testing import synthetic_tokens

    tokens, targets = synthetic_tokens(seed * 7 + dist.get_rank(), 2, 8, 32)
    return model.loss(tokens, targets)


def _steady_state_work() -> dict:
    """Gradients made, copied into and released in the steps after
    warm-up, and the kept memory seen by the first block's forward."""
    from fsdp_compose.buffers import flat_grad

    model = tiny_gpt()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    held_at_forward = []

    def record(_module, _args):
        held_at_forward.append(sum(g._kept.storage.nbytes() for g in _gradients(model)
                                   if g._kept is not None))
    model.blocks[0].register_forward_pre_hook(record)
    for seed in range(WARMUP):
        _loss(model, seed).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    kept_after_warmup = [g._kept for g in _gradients(model)]
    counts = {}
    with mock.patch.object(flat_grad.KeptGradient, "__init__", autospec=True,
                           side_effect=flat_grad.KeptGradient.__init__) as made, \
            mock.patch.object(flat_grad.KeptGradient, "release", autospec=True,
                              side_effect=flat_grad.KeptGradient.release) as released, \
            mock.patch.object(flat_grad.FlatGradient, "_adopt", autospec=True,
                              side_effect=flat_grad.FlatGradient._adopt) as copied:
        for seed in range(WARMUP, WARMUP + STEPS):
            _loss(model, seed).backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
        counts = {"made": made.call_count, "released": released.call_count,
                  "copied": copied.call_count}
    counts["same_kept"] = all(a is b for a, b in zip(kept_after_warmup,
                                                     [g._kept for g in _gradients(model)]))
    counts["buffers"] = sum(g._kept is not None for g in _gradients(model))
    counts["held_at_forward"] = held_at_forward
    return counts


@pytest.mark.parametrize("world", [1, 2])
def test_the_steady_state_makes_no_gradient_and_holds_none_at_forward(world):
    for counts in run_distributed(world, _steady_state_work):
        assert counts["buffers"] > 0, "no gradient was kept"
        assert counts["made"] == 0, f"a sharded gradient was made anew: {counts}"
        assert counts["same_kept"], counts
        assert counts["released"] == counts["buffers"] * STEPS, counts
        # over ranks the reduce-scatter writes into it; over one rank the gradient is copied
        assert counts["copied"] == (counts["buffers"] * STEPS if world == 1 else 0), counts
        # the first block's forward runs after the root's pre-forward released them all
        assert counts["held_at_forward"][WARMUP:] == [0] * STEPS, counts


def _kept_bytes_after_zero_grad(how: str) -> dict:
    """Bytes the kept gradients hold right after each step's ``zero_grad``
    (``how``: which one, and what the user keeps), and their total while
    the ``.grad`` still view them (after the optimizer step)."""
    model = tiny_gpt()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    target = model.blocks[1].mlp[0].weight
    after, published, kept = [], [], None
    for seed in range(WARMUP + STEPS):
        _loss(model, seed).backward()
        optim.step()
        for grad in _gradients(model):
            grad.assert_consistent()  # kept (in use)
        published.append(sum(g._kept.storage.nbytes() for g in _gradients(model)
                             if g._kept is not None))
        if how == "holding":
            kept = target.grad
        if how == "model":
            model.zero_grad()
        else:
            optim.zero_grad(set_to_none=how != "set_to_zero")
        after.append(sum(g._kept.storage.nbytes() for g in _gradients(model)
                         if g._kept is not None))
        for grad in _gradients(model):
            grad.assert_consistent()  # released, or held by the user
    held = target.grad if how == "set_to_zero" else kept
    return {"after": after, "published": published,
            "target": 0 if held is None else held.untyped_storage().nbytes()}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("how", ["optimizer", "model", "set_to_zero", "holding"])
def test_zero_grad_gives_the_memory_back_at_once(how, world):
    """``optimizer.zero_grad()`` and ``model.zero_grad()`` (``set_to_none``,
    the default) give back the memory of the gradients they cleared, as
    FSDP2 frees them there, not only at the next forward; gradients still
    viewed (``set_to_none=False``) or held by the user keep theirs."""
    for res in run_distributed(world, _kept_bytes_after_zero_grad, how):
        assert all(res["published"][WARMUP:]), res
        after = res["after"][WARMUP:]
        if how in ("optimizer", "model"):
            assert after == [0] * STEPS, f"zero_grad left kept gradients holding memory: {res}"
        elif how == "set_to_zero":
            assert after == res["published"][WARMUP:], res  # zeroed in place, still .grad
        else:  # the held gradient's buffer keeps its memory, the others give theirs back
            assert 0 < res["target"] and all(0 < a < p for a, p in
                                             zip(after, res["published"][WARMUP:])), res


def _train_holding(hold: str) -> dict:
    """Train; after the second step's backward keep ``hold`` of one
    parameter's ``.grad`` across ``zero_grad`` and two more steps. Returns
    every step's gradients, what was held and its values when taken."""
    model = tiny_gpt()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    target = model.blocks[1].mlp[0].weight
    grads, held, snapshot = [], None, None
    for seed in range(WARMUP + 2):
        _loss(model, seed).backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        if seed == WARMUP - 1 and hold != "nothing":
            grad = target.grad
            held = {"reference": lambda: grad,
                    "detached": lambda: grad.detach(),
                    "slice": lambda: grad[1:],
                    "in-a-list": lambda: [grad],
                    "numpy": lambda: grad.numpy()}[hold]()
            snapshot = grad.clone()
            del grad
        optim.step()
        optim.zero_grad(set_to_none=True)
    if isinstance(held, list):
        held = held[0]
    return {"grads": grads, "held": None if held is None else torch.as_tensor(held).clone(),
            "snapshot": snapshot}


def _train_plain_and_holding(hold: str) -> tuple[dict, dict]:
    return _train_holding("nothing"), _train_holding(hold)


@pytest.mark.parametrize("hold", ["reference", "detached", "slice", "in-a-list", "numpy"])
def test_what_the_user_holds_is_never_written(hold):
    for plain, holding in run_distributed(2, _train_plain_and_holding, hold):
        for step, (expected, got) in enumerate(zip(plain["grads"], holding["grads"])):
            for a, b in zip(expected, got):
                assert (a is None) == (b is None), step
                if a is not None:
                    assert torch.equal(a, b), f"step {step}: the gradients changed"
        snapshot = holding["snapshot"]
        want = snapshot[1:] if hold == "slice" else snapshot
        assert torch.equal(holding["held"], want), f"the held {hold} was overwritten"


def _train_clearing_all_but_one(sharded: bool) -> dict:
    """SGD with momentum where, after the second step, every ``.grad`` is
    cleared but one parameter's, which then accumulates over the next
    steps (``sharded``: on every rank's batch; else one process on the
    global batch). Returns the full parameters after training."""
    import torch.distributed as dist

    from fsdp_compose.testing import synthetic_tokens
    from tests._training import gather_master_params

    model = tiny_gpt(sharded)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    target = model.blocks[1].mlp[0].weight
    for seed in range(WARMUP + 2):
        if sharded:
            loss = _loss(model, seed)
        else:
            batches = [synthetic_tokens(seed * 7 + r, 2, 8, 32)
                       for r in range(dist.get_world_size())]
            loss = model.loss(torch.cat([t for t, _ in batches]), torch.cat([y for _, y in batches]))
        loss.backward()
        optim.step()
        for p in model.parameters():
            if p is not target or seed < WARMUP - 1:
                p.grad = None
        if sharded:
            for grad in _gradients(model):
                grad.assert_consistent()  # one .grad left viewing the kept gradient
    if sharded:
        return gather_master_params(model)
    return {n: p.detach().clone() for n, p in model.named_parameters()} if dist.get_rank() == 0 \
        else {}


def _train_sharded_and_alone() -> tuple[dict, dict]:
    return _train_clearing_all_but_one(True), _train_clearing_all_but_one(False)


@pytest.mark.parametrize("world", [1, 2])
def test_a_grad_left_in_place_accumulates_as_in_one_process(world):
    # over one rank the kept gradient takes the flat gradient's memory (no
    # copy); over two the reduce-scatter writes into it
    results = run_distributed(world, _train_sharded_and_alone)
    reference = results[0][1]
    for sharded, _ in results:
        assert sharded.keys() == reference.keys()
        for name, want in reference.items():
            diff = (sharded[name] - want).abs().max().item()
            assert diff <= 1e-5, f"{name} differs from one process by {diff}"
