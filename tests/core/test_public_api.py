"""The public API, pinned: ``__all__`` of every public module, as
released. A change to what users may import must change this file too
(and the CHANGELOG), so none happens by accident (e.g. in a rename).
"""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "fsdp_compose": [
        "Blocks", "CPUOffloadPolicy", "CommPolicy", "FSDPModule", "GradientReductionHandle",
        "MixedPrecisionPolicy",
        "OffloadPolicy", "OnMesh", "PrefetchPolicy",
        "ShardedGradScaler", "ShardedModule", "ShardedParamInfo", "UnshardHandle",
        "check_finite_gradients", "clip_grad_norm_", "describe", "estimate_memory",
        "flat_step", "full_params", "fully_shard", "fully_shard_by", "fully_shard_root",
        "mark_reduced_elsewhere", "materialize", "param_info", "param_norms", "propose_units",
        "register_forward_method", "register_fsdp_forward_method", "route_torch_grad_norms",
        "set_gloo_reduce_scatter_via_all_reduce", "share_comm_ctx", "sync_module_states",
    ],
    "fsdp_compose.checkpoint": [
        "CheckpointError", "CheckpointStore", "FlatLoadPlanner", "FlatSavePlanner",
        "UnitStateDictHooks", "flat_state_dict", "load_safetensors", "register_optimizer",
        "scatter_full_state_dict",
    ],
    "fsdp_compose.checkpoint.store": [
        "CheckpointError", "CheckpointStore",
    ],
    "fsdp_compose.optim": [
        "FlatStep", "StepReport", "flat_step",
    ],
    "fsdp_compose.gradients.clip": [
        "clip_grad_norm_", "param_norms",
    ],
    "fsdp_compose.params.full_params": [
        "full_params",
    ],
    "fsdp_compose.gradients.grad_scaler": [
        "ShardedGradScaler",
    ],
    "fsdp_compose.integrations.hf": [
        "ShardedTrainer", "ShardedTrainerMixin",
    ],
    "fsdp_compose.integrations.lightning.fabric": [
        "ModelParallelStrategy",
    ],
    "fsdp_compose.integrations.lightning.pytorch": [
        "ModelParallelStrategy",
    ],
    "fsdp_compose.testing": [
        "GPT", "GPTConfig", "TinyMoELM", "enable_expert_parallel", "init_from_torchrun",
        "synthetic_tokens", "train_losses",
    ],
    "fsdp_compose.tools": [
        "BufferReport", "MemoryEstimate", "ModelReport", "ParamReport", "Proposal",
        "ShardedMemTracker", "Totals", "UnitReport", "describe", "estimate_memory",
        "fully_shard_by", "fully_shard_root", "propose_units",
    ],
    "fsdp_compose.tools.planner": [
        "BACKENDS", "MemoryEstimate", "OPTIMIZER_MOMENTS", "PeakParts", "Proposal",
        "default_units", "estimate_memory", "propose_units",
    ],
    "fsdp_compose.gradients.torch_norms": [
        "install", "is_routed", "route_torch_grad_norms",
    ],
    "fsdp_compose.setup.torch_policies": [
        "as_mp_policy", "as_offload_policy",
    ],
}


@pytest.mark.parametrize("module_name", sorted(PUBLIC))
def test_public_names_are_pinned(module_name):
    if module_name.startswith("fsdp_compose.integrations.lightning"):
        pytest.importorskip("lightning")  # the [lightning] extra
    if module_name == "fsdp_compose.integrations.hf":
        pytest.importorskip("accelerate")  # the [hf] extra
    module = importlib.import_module(module_name)
    assert sorted(module.__all__) == PUBLIC[module_name], (
        f"{module_name}.__all__ changed: added {sorted(set(module.__all__) - set(PUBLIC[module_name]))}, "
        f"removed {sorted(set(PUBLIC[module_name]) - set(module.__all__))}")
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{module_name}.__all__ names what it does not define: {missing}"
