"""fsdp_compose: composable fully-sharded data parallelism for PyTorch.

``fully_shard(module)`` annotates a module in place: its parameters live in
flat buffers sharded evenly across ranks and are all-gathered for compute and
reduce-scattered after backward, while the original ``nn.Parameter`` objects
stay registered under their original names.
"""

from .comm.wire import set_gloo_reduce_scatter_via_all_reduce
from .checks.finite import check_finite_gradients
from .checks.unmanaged import mark_reduced_elsewhere
from .api import ShardedParamInfo, fully_shard, param_info
from .placements import Blocks, OnMesh
from .gradients.clip import clip_grad_norm_, param_norms
from .module_methods.forward_methods import register_forward_method, register_fsdp_forward_method
from .params.full_params import full_params
from .gradients.grad_scaler import ShardedGradScaler
from .params.init import materialize, sync_module_states
from .policies import CommPolicy, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, PrefetchPolicy
from .gradients.torch_norms import route_torch_grad_norms
from .optim import flat_step
from .tools import describe, estimate_memory, fully_shard_by, fully_shard_root, propose_units
from .module_methods.sharded_module import FSDPModule, ShardedModule, UnshardHandle, share_comm_ctx
from .module_methods.manual_finalization import GradientReductionHandle

__all__ = [
    "fully_shard", "Blocks", "OnMesh", "ShardedModule", "ShardedParamInfo", "UnshardHandle", "param_info",
    "MixedPrecisionPolicy", "CPUOffloadPolicy", "PrefetchPolicy", "CommPolicy",
    "clip_grad_norm_", "param_norms", "ShardedGradScaler", "register_forward_method",
    "materialize", "sync_module_states", "describe", "fully_shard_by", "fully_shard_root", "estimate_memory",
    "propose_units", "check_finite_gradients", "set_gloo_reduce_scatter_via_all_reduce",
    "full_params", "route_torch_grad_norms", "mark_reduced_elsewhere", "flat_step",
    "FSDPModule", "OffloadPolicy", "register_fsdp_forward_method", "share_comm_ctx",
    "GradientReductionHandle",
]
__version__ = "0.1.0"
