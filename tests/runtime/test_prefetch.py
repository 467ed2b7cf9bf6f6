"""Prefetch and in-flight limits: they change no numbers, respect the limit,
and follow the recorded order even when the control flow changes."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compose import PrefetchPolicy, fully_shard
from fsdp_compose.buffers.param_views import ViewPlan
from fsdp_compose.runtime.prefetch_order import PrefetchOrder
from fsdp_compose.runtime.state import state_of, units_below
from tests._owners import buffer_of
from tests._training import build_model, global_batch, make_optimizer, shard_blocks_and_root
from tests.harness import TEST_DEVICE, run_distributed


def peak_all_gathers_in_flight(events) -> int:
    """The most all-gathers in flight at once (a bucket's is one) in the
    queue's event log: issued, not yet completed."""
    now = peak = 0
    for event in events:
        if event.kind == "all_gather":
            now += 1 if event.what == "issue" else -1
            peak = max(peak, now)
    return peak


def train_with_policy(forward, backward, limit, steps=3):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    shard_blocks_and_root(model)
    model.set_prefetch_policy(PrefetchPolicy(forward=forward, backward=backward,
                                             max_inflight_all_gathers=limit))
    optim = make_optimizer(model, "adamw")
    losses = []
    events = []
    for step in range(steps):
        if step == 1:  # the queue exists from the first forward on
            events = state_of(model).context.collectives.record_events()
        x, y = global_batch(step, world, "plain")
        per = x.shape[0] // world
        loss = model.loss(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    params = [p.detach().clone() for p in model.parameters()]
    return {"losses": losses, "params": params, "peak_inflight": peak_all_gathers_in_flight(events)}


@pytest.mark.parametrize("world", [2, 3])
def test_prefetch_changes_no_numbers_and_respects_the_limit(world):
    off = run_distributed(world, train_with_policy, False, False, 1)
    on = run_distributed(world, train_with_policy, True, True, 2)
    deep = run_distributed(world, train_with_policy, True, True, 3)
    for a, b, c in zip(off, on, deep):
        assert a["losses"] == b["losses"] == c["losses"]
        assert all(torch.equal(p, q) and torch.equal(p, r)
                   for p, q, r in zip(a["params"], b["params"], c["params"]))
        assert a["peak_inflight"] == 1          # no prefetch: one at a time
        assert b["peak_inflight"] == 2          # prefetch happens, within the limit
        assert c["peak_inflight"] <= 3


def reductions_in_flight_at_each_gradient(limit, steps=2):
    """At each moment a unit's views node makes a flat gradient (the
    reduction input that memory holds until the reduce-scatter is waited),
    how many of the model's reductions are in flight (issued, not waited)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    shard_blocks_and_root(model)
    model.set_prefetch_policy(PrefetchPolicy(max_pending_reduces=limit))
    buffers = [b for unit in units_below(model) for b in unit.buffers]
    optim = make_optimizer(model, "adamw")
    seen = []
    original = ViewPlan.flat_gradient

    def flat_gradient(plan, grads, dtype, device):
        seen.append(sum(b.grad.is_reducing for b in buffers))
        return original(plan, grads, dtype, device)

    ViewPlan.flat_gradient = flat_gradient
    try:
        for step in range(steps):
            x, y = global_batch(step, world, "plain")
            per = x.shape[0] // world
            model.loss(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
            optim.step()
            optim.zero_grad()
    finally:
        ViewPlan.flat_gradient = original
    return {"seen": seen, "buffers": sum(b.requires_grad for b in buffers) * steps}


@pytest.mark.parametrize("limit", [1, 2])
def test_a_new_gradient_waits_for_room_among_the_reductions(limit):
    """A unit's flat gradient is made only once at most ``limit - 1``
    reductions are in flight, so the reduction it feeds keeps the limit and
    the gradients of waited ones are freed first (torch FSDP2 waits the
    previous reduce-scatter the same way; without it, one unit's gradient
    stays above FSDP2's at the end of backward)."""
    for result in run_distributed(2, reductions_in_flight_at_each_gradient, limit):
        assert len(result["seen"]) == result["buffers"] > 0, result
        assert max(result["seen"]) == limit - 1, result["seen"]


class Switchable(nn.Module):
    """Runs its three blocks in an order chosen per call, maybe skipping one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.out = nn.Linear(8, 2)

    def forward(self, x, order):
        x = self.inp(x)
        for i in order:
            x = torch.tanh(self.blocks[i](x))
        return self.out(x)


ORDERS = [(0, 1, 2), (2, 0, 1), (0, 2)]


def control_flow_changes():
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Switchable()
    shard_blocks_and_root(model)
    names = {id(buffer_of(b.weight)): f"b{i}" for i, b in enumerate(model.blocks)}
    names[id(buffer_of(model.inp.weight))] = "root"
    log = []
    forward_targets, backward_targets = PrefetchOrder.forward_targets, PrefetchOrder.backward_targets

    def label(unit):
        return names[id(unit.buffers[0])]

    def fwd(self, unit):
        targets = forward_targets(self, unit)
        log.append(("fwd", label(unit), [label(t) for t in targets]))
        return targets

    def bwd(self, unit):
        targets = backward_targets(self, unit)
        log.append(("bwd", label(unit), [label(t) for t in targets]))
        return targets
    PrefetchOrder.forward_targets, PrefetchOrder.backward_targets = fwd, bwd
    try:
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step, order in enumerate(ORDERS):
            x = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(step))
            loss = model(x[rank * 4:(rank + 1) * 4], order).square().mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach())
            left = [b for b in {id(buffer_of(p)): buffer_of(p)
                                for p in model.parameters()}.values()
                    if b.is_unsharded or b.is_gathering]
            assert not left, f"step {step}: {left} still unsharded"
            log.append(("end",))
    finally:
        PrefetchOrder.forward_targets, PrefetchOrder.backward_targets = forward_targets, backward_targets
    for loss in losses:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    model.unshard(recurse=True)
    params = [p.detach().clone() for p in (model.inp.weight, model.out.weight,
                                            *[b.weight for b in model.blocks])]
    model.reshard(recurse=True)
    return {"log": log, "losses": [l.item() for l in losses], "params": params}


def _steps(log):
    steps, current = [], []
    for entry in log:
        if entry == ("end",):
            steps.append(current)
            current = []
        else:
            current.append(entry)
    return steps


def test_prefetch_follows_recorded_order_when_control_flow_changes():
    results = run_distributed(2, control_flow_changes)
    steps = _steps(results[0]["log"])
    # step 0: no previous order, so no forward prefetch; backward in reverse
    assert [e for e in steps[0] if e[0] == "fwd" and e[2]] == []
    assert ("bwd", "b2", ["b1"]) in steps[0] and ("bwd", "b1", ["b0"]) in steps[0]
    # step 1 runs 2,0,1: forward prefetch uses step 0's order (0->1, 1->2)
    assert ("fwd", "b0", ["b1"]) in steps[1] and ("fwd", "b2", []) in steps[1]
    assert ("fwd", "root", ["b0"]) in steps[1]
    # ... and backward prefetch this iteration's order reversed: 1 -> 0 -> 2
    assert ("bwd", "b1", ["b0"]) in steps[1] and ("bwd", "b0", ["b2"]) in steps[1]
    # step 2 skips b1 although step 1's order predicts it after b0: the unused
    # prefetch is dropped (checked on the ranks: nothing is left unsharded)
    assert ("fwd", "b0", ["b1"]) in steps[2]
    assert ("bwd", "b2", ["b0"]) in steps[2]

    # numbers: same as without any prefetch, in one process on the global batch
    model = Switchable()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step, order in enumerate(ORDERS):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        loss = model(x, order).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        for res in results:
            assert abs(res["losses"][step] - loss.item()) < 1e-6
    want = [model.inp.weight, model.out.weight, *[b.weight for b in model.blocks]]
    for res in results:
        for got, ref in zip(res["params"], want):
            assert torch.allclose(got, ref, atol=1e-6)


def explicit_prefetch():
    model = build_model()
    shard_blocks_and_root(model)
    model.set_prefetch_policy(PrefetchPolicy(forward=False, backward=False))
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[2]])
    seen = []

    def probe(module, args):
        seen.append(buffer_of(model.blocks[2].ln1.weight).is_gathering
                    or buffer_of(model.blocks[2].ln1.weight).is_unsharded)
    model.blocks[1].register_forward_pre_hook(probe)
    tokens = torch.randint(97, (2, 16)).to(TEST_DEVICE)
    model.loss(tokens, tokens).backward()
    return seen


def test_explicit_forward_prefetch():
    assert run_distributed(2, explicit_prefetch)[0] == [True]


def async_unshard():
    model = build_model()
    fully_shard(model.blocks[0])
    fully_shard(model)
    handle = model.unshard(async_op=True, recurse=True)
    in_flight = buffer_of(model.blocks[0].ln1.weight).is_gathering
    handle.wait()
    full = model.blocks[0].attn.qkv.weight.shape
    model.reshard(recurse=True)
    return in_flight, tuple(full)


def test_unshard_async_op_returns_a_real_handle():
    for in_flight, shape in run_distributed(2, async_unshard):
        assert in_flight and shape == (72, 24)
