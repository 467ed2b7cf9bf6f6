"""Hybrid sharding: the all-reduce over the replicas is issued without
waiting for it and overlaps the rest of backward, with the same
numbers as one process on the global batch."""

from torch.nn.modules.module import register_module_full_backward_pre_hook

from fsdp_compose.runtime.state import state_of
from tests._training import train_reference
from tests.harness import run_distributed
from tests.parallelism.test_hsdp import _assert_parity, _train


def _train_watching_replicas(optim_name):
    """``tests/parallelism/test_hsdp._train`` on a (2, 2) mesh, recording how many
    replica all-reduces are in flight whenever a unit's backward starts."""
    in_flight = []

    def probe(module, _grad_output):
        state = state_of(module)
        if state is not None and state.context is not None:
            events = state.context.collectives.events
            if events is None:
                events = state.context.collectives.record_events()
            replicas = [e.what for e in events if e.kind == "all_reduce_replicas"]
            in_flight.append(replicas.count("issue") - replicas.count("complete"))
    handle = register_module_full_backward_pre_hook(probe)
    try:
        result = _train((2, 2), optim_name)
    finally:
        handle.remove()
    return result | {"max_in_flight": max(in_flight)}


def test_replica_all_reduce_overlaps_backward():
    results = run_distributed(4, _train_watching_replicas, "adamw", timeout=120)
    assert all(r["max_in_flight"] >= 1 for r in results), [r["max_in_flight"] for r in results]
    _assert_parity(results, train_reference(4, "adamw"))
