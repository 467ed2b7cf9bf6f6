"""The collective queue is the one home of the step's collectives:
every all-gather and reduce-scatter the backend runs was issued as one
``InFlight`` (an ``issue`` in the queue's event log) and told to the observer first, bucketed, prefetched or
called by hand (``module.unshard()``)."""

import ast
import re
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_compose import PrefetchPolicy
from fsdp_compose.checks.divergence import DivergenceMonitor
from fsdp_compose.runtime.state import state_of
from fsdp_compose.testing import GPT, GPTConfig
from tests._comm_counter import ALL_GATHER, REDUCE_SCATTER, CollectiveCounter
from tests._training import local_batch, make_optimizer, shard_blocks_and_root
from tests.harness import TEST_DEVICE, run_distributed


def _count_a_bucketed_step_and_a_manual_unshard():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = shard_blocks_and_root(GPT(GPTConfig(n_layers=4)).to(TEST_DEVICE))
    block_bytes = sum(b.layout.padded_numel * 4 for b in state_of(model.blocks[0]).unit.buffers)
    model.set_bucket_cap_mb(2.5 * block_bytes / 2 ** 20)  # buckets of two blocks
    optim = make_optimizer(model, "adamw")

    def step(index):
        x, y = local_batch(index, rank, world)
        model.loss(x, y).backward()
        optim.step()
        optim.zero_grad()

    for index in range(3):  # the verified steps (their checks add all-gathers of their own)
        step(index)
    observed: Counter = Counter()
    flights: Counter = Counter()
    members: Counter = Counter()
    originals = (DivergenceMonitor.before_all_gather, DivergenceMonitor.before_reduce_scatter)

    def before_all_gather(self, buffer, issuer_state):
        observed["all_gather"] += 1
        return originals[0](self, buffer, issuer_state)

    def before_reduce_scatter(self, buffer):
        observed["reduce_scatter"] += 1
        return originals[1](self, buffer)

    DivergenceMonitor.before_all_gather = before_all_gather
    DivergenceMonitor.before_reduce_scatter = before_reduce_scatter
    queue = state_of(model).context.collectives
    events = queue.record_events()
    try:
        with CollectiveCounter() as counter:
            step(3)
            step(4)
            before = observed["all_gather"]
            model.blocks[0].unshard()
            manual = observed["all_gather"] - before
            model.blocks[0].reshard()
    finally:
        DivergenceMonitor.before_all_gather, DivergenceMonitor.before_reduce_scatter = originals
        queue.record_events(False)
    for event in events:
        if event.what == "issue":
            flights[event.kind] += 1
            members[event.kind] += event.buffers
    buckets = [len(b.units) for b in state_of(model).context.collectives.buckets.buckets]
    return {"c10d_all_gathers": counter.counts[ALL_GATHER],
            "c10d_reduce_scatters": counter.counts[REDUCE_SCATTER],
            "flights": dict(flights), "members": dict(members), "observed": dict(observed),
            "manual": manual, "block_buffers": len(state_of(model.blocks[0]).unit.buffers),
            "buckets": buckets}


def test_every_collective_is_one_in_flight_and_observed_first():
    for result in run_distributed(2, _count_a_bucketed_step_and_a_manual_unshard):
        assert result["buckets"] and max(result["buckets"]) == 2, result
        flights, members, observed = result["flights"], result["members"], result["observed"]
        # each collective the backend ran is one InFlight of the queue ...
        assert result["c10d_all_gathers"] == flights["all_gather"] > 0, result
        assert result["c10d_reduce_scatters"] == flights["reduce_scatter"] > 0, result
        # ... buckets among them (fewer collectives than buffers) ...
        assert members["all_gather"] > flights["all_gather"], result
        assert members["reduce_scatter"] > flights["reduce_scatter"], result
        # ... and the observer was told about each buffer it carries
        assert observed["all_gather"] == members["all_gather"], result
        assert observed["reduce_scatter"] == members["reduce_scatter"], result
        # a manual unshard() goes through the same queue, observed
        assert result["manual"] == result["block_buffers"] > 0, result


def _manual_unshard_within_the_limit(limit):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = shard_blocks_and_root(GPT(GPTConfig(n_layers=4)).to(TEST_DEVICE))
    model.set_prefetch_policy(PrefetchPolicy(max_inflight_all_gathers=limit))
    x, y = local_batch(0, rank, world)
    model.loss(x, y).backward()  # lazy init, one step's collectives
    queue = state_of(model).context.collectives
    handle = model.unshard(async_op=True, recurse=True)
    in_flight = queue.inflight_all_gathers()
    handle.wait()
    unsharded = all(b.is_unsharded for m in [model, *model.blocks]
                    for b in state_of(m).unit.buffers)
    shapes = [tuple(p.shape) for p in model.blocks[0].parameters()]
    model.reshard(recurse=True)
    return in_flight, unsharded, shapes


def test_a_manual_unshard_stays_within_the_in_flight_limit():
    reference = [tuple(p.shape) for p in GPT(GPTConfig(n_layers=4)).blocks[0].parameters()]
    for limit in (1, 2):
        for in_flight, unsharded, shapes in run_distributed(2, _manual_unshard_within_the_limit,
                                                            limit):
            assert 0 < in_flight <= limit, (limit, in_flight)
            assert unsharded and shapes == reference


WIRE_WORDS = re.compile(r"custom|comms|quantiz", re.I)
"""How the queue's code would name a wire format: a user's collectives
(``set_custom_all_gather``, ``CommPolicy``'s comms) or a quantized one."""


def wire_decisions(source: str) -> list[int]:
    """The lines of ``source`` whose condition (``if``, ``while``, a
    conditional expression, ``match``) names a wire format."""
    tree = ast.parse(source)
    return sorted({node.test.lineno if hasattr(node, "test") else node.subject.lineno
                   for node in ast.walk(tree)
                   if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Match))
                   and WIRE_WORDS.search(ast.get_source_segment(
                       source, node.test if hasattr(node, "test") else node.subject) or "")})


def test_the_queue_never_asks_how_a_collective_goes_on_the_wire() -> None:
    """The buffer's wire (``comm/wire.py``) issues every collective; the
    queue holds no branch on the format (19 such lines before the wires)."""
    import fsdp_compose.runtime.collective_queue as queue

    planted = "if buffer.custom_all_gather is not None:\n    pass\nx = a if quantized else b\n"
    assert wire_decisions(planted) == [1, 3]  # the count can fail
    source = Path(queue.__file__).read_text()
    assert wire_decisions(source) == [], (
        f"runtime/collective_queue.py decides the wire format at lines {wire_decisions(source)}: "
        "let the buffer's wire (comm/wire.py) decide")
