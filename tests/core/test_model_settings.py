"""Model-wide settings (``set_prefetch_policy``, ``set_check_rank_divergence``)
made on any annotated module before the first forward are never lost: the
root's lazy init applies them to the whole model, and the same setting with
different values on two modules raises on every rank, naming both and the
root. Before this, a setting made on a block went to a prefetch order that the
root's lazy init replaced, silently.

Run: ``PYTHONPATH=. python -m pytest -q tests/core/test_model_settings.py``
"""

from __future__ import annotations

from fsdp_compose import PrefetchPolicy
from fsdp_compose.runtime.state import state_of
from tests._models import (PER_RANK, build_lm, rank_slice, rank_world, shard_blocks_and_root,
                           token_batch)
from tests.harness import run_distributed

TIMEOUT = 60
NO_PREFETCH = PrefetchPolicy(forward=False, backward=False, max_inflight_all_gathers=1)


def _step(model, step: int = 0) -> None:
    rank, world = rank_world()
    tokens, targets = token_batch(step, world * PER_RANK)
    model.loss(rank_slice(tokens, rank, world), rank_slice(targets, rank, world)).backward()


def settings_on_blocks_before_first_forward():
    model = shard_blocks_and_root(build_lm(2))
    model.blocks[0].set_prefetch_policy(NO_PREFETCH)
    model.blocks[1].set_check_rank_divergence(False)
    model.blocks[1].set_prefetch_policy(NO_PREFETCH)  # the same value twice is fine
    _step(model)
    context = state_of(model).context
    prefetch_order, collectives = context.prefetch_order, context.collectives
    assert collectives.settings is prefetch_order.settings is context.settings
    return {"policy": context.settings.prefetch_policy,
            "forced": context.settings.check_rank_divergence,
            "verified_first_iteration": collectives.observer.verifying,
            "shared": all(state_of(b).unit.prefetch_order is prefetch_order for b in model.blocks)}


def test_settings_made_on_a_block_before_the_first_forward_apply_to_the_model():
    for result in run_distributed(2, settings_on_blocks_before_first_forward, timeout=TIMEOUT):
        assert result == {"policy": NO_PREFETCH, "forced": False,
                          "verified_first_iteration": False, "shared": True}


def settings_after_init_on_a_block():
    model = shard_blocks_and_root(build_lm(2))
    _step(model)
    model.blocks[1].set_prefetch_policy(NO_PREFETCH)  # initialised: the model's prefetch order
    return state_of(model).context.prefetch_order.settings.prefetch_policy == NO_PREFETCH


def test_settings_made_on_a_block_after_the_first_forward_apply_to_the_model():
    assert all(run_distributed(2, settings_after_init_on_a_block, timeout=TIMEOUT))


def conflicting_settings():
    model = shard_blocks_and_root(build_lm(2))
    model.blocks[0].set_prefetch_policy(NO_PREFETCH)
    model.blocks[1].set_prefetch_policy(PrefetchPolicy(max_inflight_all_gathers=3))
    try:
        _step(model)
    except ValueError as error:
        return str(error)
    return None


def test_conflicting_settings_raise_on_every_rank_naming_the_root():
    messages = run_distributed(2, conflicting_settings, timeout=TIMEOUT)
    for message in messages:
        assert message is not None, "conflicting settings were accepted"
        assert "set_prefetch_policy() was called with different values" in message
        assert "'blocks.0'" in message and "'blocks.1'" in message
        assert "on the root module <root>" in message


def merged_fields_and_describe():
    """A whole policy on one block and one of its fields on another merge
    field by field (the field applied on top of the policy, whichever module
    came first); ``describe()`` shows the policy before the first forward."""
    from fsdp_compose.tools.describe import describe

    model = shard_blocks_and_root(build_lm(2))
    model.blocks[0].set_reduce_scatter_max_input_buffers(3)
    model.blocks[1].set_prefetch_policy(NO_PREFETCH)
    model.blocks[1].set_is_last_backward(True)
    before = describe(model).prefetch_policy
    _step(model)
    settings = state_of(model).context.settings
    return {"described": before, "policy": settings.prefetch_policy,
            "last": settings.is_last_backward}


def test_a_policy_and_one_of_its_fields_on_two_blocks_merge_field_by_field():
    import dataclasses
    expected = dataclasses.replace(NO_PREFETCH, max_pending_reduces=3)
    for result in run_distributed(2, merged_fields_and_describe, timeout=TIMEOUT):
        assert result == {"described": expected, "policy": expected, "last": True}


def test_merge_changes_names_the_method_both_units_and_the_root():
    import pytest

    from fsdp_compose.runtime.model_settings import ModelSettings, merge_changes

    merged = merge_changes([("'a'", {"bucket_cap_mb": 1.0}), ("'b'", {"bucket_cap_mb": 1.0,
                                                                     "is_last_backward": False})],
                           "<root>")
    settings = ModelSettings()
    settings.change_all(merged)
    assert (settings.bucket_cap_mb, settings.is_last_backward) == (1.0, False)
    with pytest.raises(ValueError, match=r"set_bucket_cap_mb\(\) was called with different values "
                                         r"on 'a' \(1.0\) and 'b' \(4.0\).*root module <root>"):
        merge_changes([("'a'", {"bucket_cap_mb": 1.0}), ("'b'", {"bucket_cap_mb": 4.0})], "<root>")
