"""FSDP2's module methods that change a unit's collectives: custom
all-gathers and reduce-scatters, the reduction hook, the replica
all-reduce, a second process group for reduce-scatters, and the settings
that only mean something on CUDA. Mixed into :class:`ShardedModule`.

Each takes FSDP2's arguments in FSDP2's order. A unit none of them touched
keeps the plain collective path (``FlatBuffer.comms is None``); see
``comm/custom.py`` for what the others change.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..comm.custom import UnitComms
from .model_settings import MAX_PENDING_REDUCES
from .state import FullyShardState, state_of, states_below


class ShardedCommMethods:
    """The collective-changing methods of :class:`ShardedModule`."""

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Hybrid sharding: with ``False``, each backward reduce-scatters
        within the shard group and keeps the result (summed over the
        backwards) instead of all-reducing it over the replicas; the next
        backward with ``True`` all-reduces the sum once (gradient
        accumulation that pays the replica all-reduce once per step). The
        gradients of the backwards with ``False`` are not published to
        ``.grad`` until then. Without replicas it changes nothing.
        ``set_requires_gradient_sync(False)`` skips both collectives."""
        for state in _states(self, recurse):
            state.unit.custom_comms().requires_all_reduce = bool(requires_all_reduce)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream: Optional[object] = None) -> None:
        """Call ``hook(reduce_output)`` on every gradient reduction of this
        unit before it is added to the sharded gradient: the reduce-scatter's
        output under FSDP, the replica all-reduce's under hybrid sharding
        (not called for a reduce-scatter kept by
        ``set_requires_all_reduce(False)``). Changes it makes in place count.
        It sees the sum where the library divides locally afterwards
        (``set_gradient_divide_factor``, ``set_force_sum_reduction_for_comms``)
        and the mean where the collective averaged, as FSDP2's does.

        ``stream``: FSDP2 runs the hook there; the library runs it on the
        current stream (where the reduction's result is ordered), so only
        ``None`` is accepted."""
        unit = _own(self).unit
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
        """Route every all-gather of this unit's parameters, a bucket's
        included, through ``comm``, an object with torch's
        ``torch.distributed.fsdp.AllGather`` protocol (``allocate(size, *,
        dtype, device)`` and ``__call__(output_tensor, input_tensor, group,
        async_op)``); see [Note: custom collectives] in ``comm/custom.py``."""
        comms = _custom_slot(self, comm, "set_custom_all_gather")
        comms.all_gather = comm

    def set_custom_reduce_scatter(self, comm: object) -> None:
        """Route every gradient reduce-scatter of this unit, a bucket's
        included, through ``comm``, an object with torch's
        ``torch.distributed.fsdp.ReduceScatter`` protocol (``allocate`` and
        ``__call__(output_tensor, input_tensor, group, op, async_op)``); the
        op is ``SUM`` or ``AVG`` as the library's own reduction would use."""
        comms = _custom_slot(self, comm, "set_custom_reduce_scatter")
        comms.reduce_scatter = comm

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """At most ``max_input_buffers`` gradient reduce-scatters in flight,
        each keeping its input alive (FSDP2's default and the library's is
        1). A setting of the whole model, ``PrefetchPolicy.max_pending_reduces``
        (``recurse`` is accepted for FSDP2's signature)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        _own(self).change_model_setting(MAX_PENDING_REDUCES, max_input_buffers)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """With ``True``, reduce-scatters run on a process group of their own
        over the shard group's ranks (one new group per distinct set of
        ranks, made now: call it on every rank), so they can progress beside
        the all-gathers; ``False``: back to the shard group."""
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for state in _states(self, recurse):
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
        """FSDP2 makes its all-gather streams wait for ``event`` instead of
        the current stream. The library issues its all-gathers on the
        current stream, after the optimizer step already, so there is
        nothing to wait for: accepted and dropped (as FSDP2 drops it at the
        next root forward)."""
        _own(self)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """FSDP2 all-gathers into symmetric memory (NCCL). Not available on
        a CPU mesh (``RuntimeError``, as FSDP2), and not implemented on CUDA
        (``NotImplementedError``): the all-gather writes straight into the
        unit's unsharded buffer, which is not allocated from symmetric memory."""
        unit = _own(self).unit
        if unit.group.device.type != "cuda":
            raise RuntimeError(f"set_symm_mem_for_comm on {unit.name}: SymmetricMemory does not "
                               f"find allocation backend {backend} (the mesh is on "
                               f"{unit.group.device.type}; FSDP2 raises the same)")
        raise NotImplementedError(
            f"set_symm_mem_for_comm on {unit.name}: fsdp_compose does not allocate unsharded "
            "buffers from symmetric memory; leave it unset")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """FSDP2 allocates its staging buffers with the process group's
        allocator. A CPU (gloo) group has none, so, as in FSDP2, nothing
        changes there; on CUDA it is not implemented (``NotImplementedError``)."""
        unit = _own(self).unit
        if enable and unit.group.device.type != "cpu":
            raise NotImplementedError(
                f"set_allocate_memory_from_process_group_for_comm on {unit.name}: not "
                "implemented on CUDA; the collectives write into the library's own buffers")

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated (as in FSDP2): use :meth:`set_gradient_divide_factor`."""
        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)  # type: ignore[attr-defined]


def _custom_slot(module: object, comm: object, method: str) -> UnitComms:
    """The unit's comms, after checking ``comm`` and that it can be used."""
    unit = _own(module).unit
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(f"{method} on {unit.name}: expected an object with allocate() and "
                        f"__call__ (torch.distributed.fsdp's Comm protocol), got "
                        f"{type(comm).__name__}")
    if any(b.gather_quantizer is not None or b.reduce_quantizer is not None for b in unit.buffers):
        raise ValueError(f"{method} on {unit.name}: the unit has quantized collectives "
                         "(CommPolicy); use one or the other")
    return unit.custom_comms()


def _own(module: object) -> FullyShardState:
    state = state_of(module)  # type: ignore[arg-type]
    if state is None:
        raise AssertionError(f"{type(module).__name__} has no fully_shard state")
    return state


def _states(module: object, recurse: bool) -> list[FullyShardState]:
    return states_below((module,)) if recurse else [_own(module)]  # type: ignore[arg-type]
