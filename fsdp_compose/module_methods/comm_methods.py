"""FSDP2's module methods that change a unit's collectives, mixed into
:class:`ShardedModule`. A unit none of them touched keeps the plain path
(``FlatBuffer.comms is None``).
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..comm.custom import UnitComms
from ..runtime.model_settings import MAX_PENDING_REDUCES
from ..runtime.state import own_state, states_at


class ShardedCommMethods:
    """The collective-changing methods of :class:`ShardedModule`."""

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Hybrid sharding: with ``False``, each backward reduce-scatters and keeps
        the sum; the next backward with ``True`` all-reduces it over the replicas
        once and publishes ``.grad``. No effect without replicas."""
        for state in states_at(self, recurse):
            state.unit.custom_comms().requires_all_reduce = bool(requires_all_reduce)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream: Optional[object] = None) -> None:
        """Call ``hook(reduce_output)`` on each gradient reduction of this unit
        (under hybrid sharding, the replica all-reduce's output) before it is
        added to the sharded gradient; in-place changes count. It sees the sum
        where the division comes afterwards, else the mean. ``stream``: only
        ``None`` (``ValueError`` under hybrid sharding, as FSDP2, else
        ``NotImplementedError``). ``TypeError`` for a non-callable ``hook``."""
        unit = own_state(self).unit
        if stream is not None:
            if unit.group.replicate_size > 1:
                raise ValueError(f"set_all_reduce_hook on {unit.name}: stream cannot be set "
                                 "when using hybrid sharding (as in FSDP2)")
            raise NotImplementedError(
                f"set_all_reduce_hook on {unit.name}: the hook runs on the current stream, "
                "where the reduction's result is ordered; pass stream=None")
        if hook is not None and not callable(hook):
            raise TypeError(f"set_all_reduce_hook on {unit.name}: expected a callable, "
                            f"got {type(hook).__name__}")
        unit.custom_comms().all_reduce_hook = hook

    def set_custom_all_gather(self, comm: object) -> None:
        """Route every all-gather of this unit through ``comm``, which has the
        protocol of torch's ``AllGather`` (``allocate(size, *, dtype, device)``,
        ``__call__(output_tensor, input_tensor, group, async_op)``); torch keeps
        it private, as ``torch.distributed.fsdp._fully_shard._fsdp_api.AllGather``,
        and subclassing it is optional. See [Note: custom collectives].
        ``TypeError`` without that protocol, ``ValueError`` on a unit with
        quantized collectives."""
        comms = _custom_slot(self, comm, "set_custom_all_gather")
        comms.all_gather = comm

    def set_custom_reduce_scatter(self, comm: object) -> None:
        """The same for gradient reduce-scatters, with the protocol of torch's
        private ``torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter``
        (``__call__(output_tensor, input_tensor, group, op, async_op)``, op
        ``SUM`` or ``AVG``)."""
        comms = _custom_slot(self, comm, "set_custom_reduce_scatter")
        comms.reduce_scatter = comm

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """At most ``max_input_buffers`` reduce-scatters in flight (a positive int,
        default 1; ``TypeError``/``ValueError`` otherwise), for the whole model.
        ``recurse`` is FSDP2's signature."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        own_state(self).change_model_setting(MAX_PENDING_REDUCES, max_input_buffers)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """``True``: reduce-scatters run on a new process group over the shard
        group's ranks (call it on every rank); ``False``: the shard group."""
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for state in states_at(self, recurse):
            unit = state.unit
            if not enable:
                if unit.settings.comms is not None:
                    unit.settings.comms.reduce_scatter_group = None
                continue
            comms = unit.custom_comms()
            ranks = tuple(dist.get_process_group_ranks(unit.group.process_group))
            if ranks not in made:
                made[ranks] = comms.reduce_scatter_group or dist.new_group(
                    list(ranks), use_local_synchronization=True)
            comms.reduce_scatter_group = made[ranks]

    def set_post_optim_event(self, event: object) -> None:
        """Accepted and dropped: collectives run on the current stream, after the
        optimizer step already."""
        own_state(self)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Not supported: ``RuntimeError`` on a CPU mesh (as FSDP2),
        ``NotImplementedError`` on CUDA."""
        unit = own_state(self).unit
        if unit.group.device.type != "cuda":
            raise RuntimeError(f"set_symm_mem_for_comm on {unit.name}: SymmetricMemory does not "
                               f"find allocation backend {backend} (the mesh is on "
                               f"{unit.group.device.type}; FSDP2 raises the same)")
        raise NotImplementedError(
            f"set_symm_mem_for_comm on {unit.name}: fsdp_compose does not allocate unsharded "
            "buffers from symmetric memory; leave it unset")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """No effect on the CPU (gloo has no allocator); ``NotImplementedError`` on
        CUDA."""
        unit = own_state(self).unit
        if enable and unit.group.device.type != "cpu":
            raise NotImplementedError(
                f"set_allocate_memory_from_process_group_for_comm on {unit.name}: not "
                "implemented on CUDA; the collectives write into the library's own buffers")

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated (as in FSDP2): use :meth:`set_gradient_divide_factor`."""
        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)  # type: ignore[attr-defined]


def _custom_slot(module: object, comm: object, method: str) -> UnitComms:
    unit = own_state(module).unit
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(f"{method} on {unit.name}: expected an object with allocate() and "
                        f"__call__ (torch.distributed.fsdp's Comm protocol), got "
                        f"{type(comm).__name__}")
    if any(b.wire.quantizes for b in unit.buffers):
        raise ValueError(f"{method} on {unit.name}: the unit has quantized collectives "
                         "(CommPolicy); use one or the other")
    return unit.custom_comms()

