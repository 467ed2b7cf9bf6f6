"""Every private torch name fsdp_compose uses, in one place.

Each is looked up by feature, never by version: a missing one becomes a
stand-in raising :class:`TorchFeatureMissing`, or a stated fallback.

Exempt, used directly: ``Tensor._version``; ``nn.Module``'s
``_parameters``, ``_buffers``, ``_modules``; the overridden methods
:func:`require_override` checks.
"""

from __future__ import annotations

import importlib
import operator
import weakref
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

MIN_TORCH = "2.11"
"""For messages only."""


class TorchFeatureMissing(RuntimeError):
    """This torch lacks a private name fsdp_compose needs."""


MISSING_MARK = "__fsdp_compose_missing__"
"""Attribute of every stand-in: the name this torch lacks."""


def _message(name: str, purpose: str, since: Optional[str]) -> str:
    head = f"fsdp_compose needs {name} for {purpose}, which torch {torch.__version__} does not have"
    if since:
        return f"{head}: install torch>={since}."
    return (f"{head}: fsdp_compose supports torch>={MIN_TORCH} up to the newest version its "
            f"README lists as tested; a newer torch may have renamed or removed it (please "
            f"report the version).")


def _missing(name: str, purpose: str, since: Optional[str] = None, cls: bool = False) -> Any:
    """A stand-in raising :class:`TorchFeatureMissing` when used."""
    message = _message(name, purpose, since)

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise TorchFeatureMissing(message)

    if cls:
        return type(name.rsplit(".", 1)[-1], (), {"__init__": fail, "__doc__": message,
                                                  "__module__": __name__, MISSING_MARK: name})
    fail.__doc__ = message
    setattr(fail, MISSING_MARK, name)
    return fail


def _lookup(module: str, attr: str, purpose: str, since: Optional[str] = None,
            cls: bool = False) -> Any:
    """``module.attr``, else a stand-in."""
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return _missing(f"{module}.{attr}", purpose, since, cls)


def _method(owner: Any, attr: str, purpose: str, since: Optional[str] = None) -> Any:
    """``owner.attr``, else a stand-in."""
    found = getattr(owner, attr, None)
    if found is None:
        return _missing(f"{getattr(owner, '__module__', '')}.{getattr(owner, '__name__', owner)}.{attr}",
                        purpose, since)
    return found


# --- composable API
contract: Callable[..., Any] = _lookup(
    "torch.distributed._composable", "contract", "registering fully_shard as a composable API")
REGISTRY_KEY: str = _lookup("torch.distributed._composable.contract", "REGISTRY_KEY",
                            "reading the composable-API registry of a module")
ComposableState: type = _lookup("torch.distributed._composable_state", "_State",
                                "the base class of fully_shard's per-module state", cls=True)

# --- autograd
def _flatten_in_python(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


flatten_dense_tensors: Callable[[Sequence[torch.Tensor]], torch.Tensor] = getattr(
    torch._C._nn, "flatten_dense_tensors", None) or _flatten_in_python
"""``torch.cat`` of the flattened ``tensors``."""


_current_graph_task_id = _method(torch._C, "_current_graph_task_id",
                                 "telling whether autograd is running a backward")


def current_graph_task_id() -> int:
    """The id of the backward running on this thread, ``-1`` outside one."""
    return _current_graph_task_id()


profiler_active: Callable[[], bool] = _method(
    torch._C._autograd, "_profiler_enabled",
    "telling whether a torch profiler records (profiler ranges are skipped otherwise)")


def _autograd_callback_queue() -> Callable[[Callable[[], None]], None]:
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        return _missing("torch.autograd.Variable._execution_engine.queue_callback",
                        "running the end of backward")
    return queue


queue_autograd_callback: Callable[[Callable[[], None]], None] = _autograd_callback_queue()
"""Run ``callback`` when the running backward ends (bound once)."""


unsafe_preserve_version_counter: Callable[..., Any] = _lookup(
    "torch.autograd.grad_mode", "_unsafe_preserve_version_counter",
    "writing the unsharded buffer without bumping its version counter")
unsafe_set_version_counter: Callable[..., Any] = _method(
    torch._C._autograd, "_unsafe_set_version_counter",
    "restoring the unsharded buffer's version counter after the all-gather")


def post_accumulate_grad_hooks(param: torch.Tensor) -> dict:
    """The hooks ``param.register_post_accumulate_grad_hook`` registered."""
    try:
        return param._post_accumulate_grad_hooks or {}
    except AttributeError:
        _missing("torch.Tensor._post_accumulate_grad_hooks",
                 "running post-accumulate-grad hooks on reduced gradients")()
        raise  # unreachable


functorch_transforms_active: Callable[[], bool] = getattr(
    torch._C, "_are_functorch_transforms_active", None) or (lambda: True)
"""A custom autograd function must go through ``Function.apply``."""


post_accumulate_grad_hooks_or_none: Callable[[torch.Tensor], Optional[dict]] = (
    operator.attrgetter("_post_accumulate_grad_hooks")
    if hasattr(torch.Tensor, "_post_accumulate_grad_hooks") else _missing(
        "torch.Tensor._post_accumulate_grad_hooks",
        "running post-accumulate-grad hooks on reduced gradients"))
"""``param``'s post-accumulate-grad hooks or ``None``; a C getter."""


# --- storage
_swap_data_ptr = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)

CAN_SWAP_STORAGE_DATA: bool = _swap_data_ptr is not None
"""torch>=2.12; without it the CPU staging pool is off."""


def _storage_data_swapper(method: Optional[Callable[..., None]]) -> Callable[..., None]:
    return method if method is not None else _missing(
        "torch.UntypedStorage._swap_data_ptr_",
        "moving memory between storages, in the CPU staging pool", since="2.12")


swap_storage_data: Callable[[torch.UntypedStorage, torch.UntypedStorage], None] = \
    _storage_data_swapper(_swap_data_ptr)
"""Exchange the memory of two storages."""


_storage_use_count = _lookup("torch._C", "_storage_Use_Count",
                             "telling whether a kept gradient is still referenced")
_tensor_use_count = _method(torch.Tensor, "_use_count",
                            "telling whether a kept gradient is still referenced")


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """References to the storage's ``StorageImpl``."""
    return _storage_use_count(storage._cdata)


storage_key_use_count: Callable[[int], int] = _storage_use_count
""":func:`storage_use_count` by :func:`storage_key`."""

tensor_use_count: Callable[[torch.Tensor], int] = _tensor_use_count
"""A tensor's ``TensorImpl`` reference count."""


CAN_COUNT_USES: bool = not (hasattr(_storage_use_count, MISSING_MARK)
                            or hasattr(_tensor_use_count, MISSING_MARK))
"""Else the sharded gradient is made anew per reduction."""


def storage_key(storage: torch.UntypedStorage) -> int:
    """An id of the storage's memory block, fake tensors included."""
    return storage._cdata


# --- collectives
_get_default_store = _lookup("torch.distributed.distributed_c10d", "_get_default_store",
                             "the rendezvous store of the default process group")


def default_store() -> dist.Store:
    """The default process group's store."""
    return _get_default_store()


_resolve_process_group = _lookup("torch.distributed.distributed_c10d", "_resolve_process_group",
                                 "a process group from its name (another rank's answer)")


def group_named(name: str) -> dist.ProcessGroup:
    """The process group called ``name`` on this rank."""
    return _resolve_process_group(name)


def forget_mesh_groups(mesh: Any) -> None:
    """[Note: process groups at exit]."""
    registry = getattr(mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()


def sequence_number(group: dist.ProcessGroup) -> int:
    """``group``'s sequence number; raises where there is none."""
    return group._get_sequence_number_for_group()


foreach_norm: Callable[..., Any] = _method(torch, "_foreach_norm", "norms of many tensors at once")
foreach_mul_: Callable[..., Any] = _method(torch, "_foreach_mul_", "scaling many tensors at once")
_privateuse1_backend_name = _method(torch._C, "_get_privateuse1_backend_name",
                                    "the name of an out-of-tree device backend")


def privateuse1_backend_name() -> str:
    return _privateuse1_backend_name()


# --- DTensor and DCP
StridedShard: type = _lookup("torch.distributed.tensor.placement_types", "_StridedShard",
                             "FSDP2's placement of tensor-parallel shards (FSDP x TP)", cls=True)
DTensorSpec: type = _lookup("torch.distributed.tensor._dtensor_spec", "DTensorSpec",
                            "building a DTensor around a lazy chunk", cls=True)
TensorMeta: type = _lookup("torch.distributed.tensor._dtensor_spec", "TensorMeta",
                           "building a DTensor around a lazy chunk", cls=True)
compute_local_shape_and_global_offset: Callable[..., Any] = _lookup(
    "torch.distributed.tensor._utils", "compute_local_shape_and_global_offset",
    "the offsets of a rank's chunk in a state dict")
create_write_items_for_dtensor: Callable[..., Any] = _lookup(
    "torch.distributed.checkpoint.planner_helpers", "_create_write_items_for_dtensor",
    "planning a checkpoint write of a DTensor")
flatten_state_dict: Callable[..., Any] = _lookup(
    "torch.distributed.checkpoint._nested_dict", "flatten_state_dict",
    "flattening nested state dicts as DCP's planners do")


def concatenate_meshes(meshes: list[Any]) -> Any:
    """One mesh of ``meshes``' dims; raises unless sliced from one mesh."""
    concatenate = getattr(type(meshes[0]), "_concatenate", None)
    if concatenate is None:
        _missing("torch.distributed.device_mesh.DeviceMesh._concatenate",
                 "the (dp, tp) mesh of a tensor-parallel parameter's state dict")()
    return concatenate(meshes)


def local_tensor(value: Any) -> torch.Tensor:
    """A ``DTensor``'s local tensor object itself."""
    return value._local_tensor


def dtensor_spec(value: Any) -> Any:
    return value._spec


make_wrapper_subclass: Callable[..., Any] = _method(
    torch.Tensor, "_make_wrapper_subclass", "tensors with a shape but no memory (lazy chunks)")

pytree: ModuleType = importlib.import_module("torch.utils._pytree")

# --- tracing tools (imported on first use)
TorchDispatchMode: type = _lookup("torch.utils._python_dispatch", "TorchDispatchMode",
                                  "watching the ops of a traced forward (memory planner)", cls=True)


def fake_tensor_mode(**kwargs: Any) -> Any:
    return _lookup("torch._subclasses.fake_tensor", "FakeTensorMode",
                   "tracing a model without memory (memory planner)", cls=True)(**kwargs)


def local_scalar_dense_op() -> Any:
    op = getattr(torch.ops.aten, "_local_scalar_dense", None)
    if op is None:
        _missing("torch.ops.aten._local_scalar_dense", "seeing scalar reads in a traced forward")()
    return op.default


def mem_tracker_class() -> type:
    """torch's ``MemTracker`` class (its import is heavy)."""
    return _lookup("torch.distributed._tools.mem_tracker", "MemTracker",
                   "torch's MemTracker (fsdp_compose.tools.mem_tracker)", cls=True)


def composable_checkpoint() -> Callable[..., Any]:
    """``torch.distributed._composable.checkpoint``."""
    return _lookup("torch.distributed._composable", "checkpoint",
                   "torch's composable activation checkpointing")


def mem_tracker_grad_kind() -> Any:
    """The category torch's ``MemTracker`` counts a gradient under."""
    return _lookup("torch.distributed._tools.mem_tracker", "_MemRefType",
                   "torch's MemTracker categories (fsdp_compose.tools.mem_tracker)").GRAD


lazy_dynamo_disable: Callable[[Callable[..., Any]], Callable[..., Any]] = getattr(
    torch, "_disable_dynamo", None) or (lambda fn: fn)
"""``torch._disable_dynamo``, else ``fn`` itself."""


def dynamo_disable(fn: Callable[..., Any], recursive: bool = True) -> Callable[..., Any]:
    disable = _lookup("torch._dynamo", "disable", "running hooks outside torch.compile's graphs")
    return disable(fn, recursive=recursive)


# --- optimizers (optim/)
default_to_fused_or_foreach: Callable[..., tuple[bool, bool]] = _lookup(
    "torch.optim.optimizer", "_default_to_fused_or_foreach",
    "choosing foreach or for-loop as torch's optimizers do (fsdp_compose.flat_step)")
optimizer_scalar_dtype: Callable[..., torch.dtype] = _lookup(
    "torch.optim.optimizer", "_get_scalar_dtype",
    "the dtype of an optimizer's 'step' counter (fsdp_compose.flat_step)")
foreach_add_: Callable[..., None] = _method(
    torch, "_foreach_add_", "adding one to many 'step' counters in one call")
foreach_mul_: Callable[..., None] = _method(
    torch, "_foreach_mul_", "AdamW's weight decay on many tensors, as its foreach step applies it")



def init_optimizer_group(optimizer: Any, group: dict, lists: int) -> None:
    """torch's own state creation, as its first step makes it."""
    _method(type(optimizer), "_init_group",
            "making optimizer state without a step")(optimizer, group, *[[] for _ in range(lists)])


def replace_dcp_init_optim_state(replacement: Callable[[Any], None]) -> Optional[Callable[[Any], None]]:
    """Replace DCP's ``_init_optim_state``; returns the old one."""
    module = importlib.import_module("torch.distributed.checkpoint.state_dict")
    original = getattr(module, "_init_optim_state", None)
    if original is not None:
        module._init_optim_state = replacement
    return original


def is_lr_scheduler_step(step: Any) -> bool:
    """Whether ``step`` is an ``LRScheduler``'s wrapper."""
    return bool(getattr(step, "_wrapped_by_lr_sched", False))


def lr_scheduler_step(optimizer: Any, step: Callable[..., Any]) -> Callable[..., Any]:
    """An ``LRScheduler``'s wrapper around ``step(optimizer, ...)``, holding
    the optimizer weakly."""
    ref = weakref.ref(optimizer)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True
        return step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return wrapper


def view_base(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """``tensor``'s base (``None``: not a view)."""
    return tensor._base


# --- overrides
def require_override(owner: type, name: str, purpose: str) -> None:
    """``owner`` still has the method ``name`` a package class overrides."""
    if not callable(getattr(owner, name, None)):
        raise TorchFeatureMissing(_message(f"{owner.__module__}.{owner.__qualname__}.{name}",
                                           purpose, None))
