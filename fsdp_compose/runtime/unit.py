"""One unit: the flat buffers of one ``fully_shard`` call and their
transitions; ``state.py`` decides when they run.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook, saved_tensors_hooks

from .._torch_private import profiler_active
from ..buffers.flat_buffer import FlatBuffer
from ..buffers.flat_grad import ReduceOptions
from ..buffers.records import ParamRecord, buffer_policy, policy_for
from ..comm.custom import UnitComms
from ..comm.custom import CustomWire
from ..comm.groups import ShardGroup, post_forward_group
from ..policies import CommPolicy, CPUOffloadPolicy, MixedPrecisionPolicy
from .tracing import call_profiled
from .collective_queue import CollectiveQueue
from .._naming import user_class_name
from .prefetch_order import PrefetchOrder
from .tensors import map_floating_tensors, tensors_requiring_grad
from .training_state import TrainingState
from .unit_paths import CollectivePath


@dataclass(slots=True)
class UnitSettings:
    """Policies are fixed at annotation; only :meth:`change` writes the
    rest, never during an iteration."""

    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    offload_policy: Optional[CPUOffloadPolicy] = None
    comm_policy: CommPolicy = field(default_factory=CommPolicy)
    reshard_after_forward: Optional[bool] = None
    """``None``: reshard after forward unless this is the root."""
    post_forward_group: Optional[ShardGroup] = None
    """``reshard_after_forward=k``, ``1 < k < F``: backward gathers from these ``k``."""
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True
    unshard_in_backward: bool = True
    """``False``: no all-gather in backward (it reads no parameter)."""
    reduce_options: ReduceOptions = field(default_factory=ReduceOptions)
    reduce_scatter_unused_params: bool = False
    """Reduced at the end of backward (``reduce_deferred``)."""
    forward_prefetch: Optional[list[Unit]] = None
    """``None``: the recorded order."""
    backward_prefetch: Optional[list[Unit]] = None
    comms: Optional[UnitComms] = None
    """``comm/custom.py``; shared with every buffer."""

    def change(self, name: str, value: Any) -> None:
        """One setting, by field name, or a field of ``reduce_options``
        (``divide_factor``, ``force_sum``); never a policy."""
        if name in ReduceOptions._fields:
            self.reduce_options = self.reduce_options._replace(**{name: value})
        else:
            assert name in _CHANGEABLE, f"not a changeable unit setting: {name!r}"
            setattr(self, name, value)


_CHANGEABLE = frozenset(UnitSettings.__dataclass_fields__) - {
    "mp_policy", "offload_policy", "comm_policy"}


class Unit:
    """Every transition is idempotent."""

    __slots__ = ('backward_without_hook', 'buffers', 'casts_inputs', 'casts_output',
                 'collectives', 'group', 'is_root', 'layout_changed', 'managed_modules', 'modules',
                 'name', 'path', 'prefetch_order', 'settings', 'training_state',
                 'backward_started', 'ties', 'tied_holds', '_backward_possible', '_buffer_of',
                 '_frozen_uses', '_modules_to_run', '_saved_guard', '__dict__', '__weakref__')

    def __init__(self, modules: Sequence[nn.Module], managed_modules: Sequence[nn.Module],
                 records_by_group: Sequence[list[ParamRecord]], group: ShardGroup,
                 reshard_after_forward: Union[bool, int, None],
                 mp_policy: Optional[MixedPrecisionPolicy] = None,
                 offload_policy: Optional[CPUOffloadPolicy] = None,
                 comm_policy: Optional[CommPolicy] = None) -> None:
        # Structure
        self.modules: tuple[nn.Module, ...] = tuple(modules)
        """The annotated module(s) whose hooks drive the unit."""
        self.managed_modules: tuple[nn.Module, ...] = tuple(managed_modules)
        """Its subtree minus earlier units' subtrees."""
        self.group: ShardGroup = group
        self.settings: UnitSettings = UnitSettings(mp_policy or MixedPrecisionPolicy(), offload_policy,
                                                   comm_policy or CommPolicy())
        mp_policy = self.settings.mp_policy
        self.casts_inputs: bool = mp_policy.param_dtype is not None and \
            mp_policy.cast_forward_inputs
        self.casts_output: bool = mp_policy.output_dtype is not None
        policy = buffer_policy(self.settings.mp_policy, offload_policy, torch.cuda.is_available(),
                               self.settings.comm_policy)
        self.buffers: list[FlatBuffer] = [
            FlatBuffer(records, records[0].group or group, post_accumulate_grad=self._post_backward,
                       policy=policy_for(records, policy),
                       before_flat_gradient=self._before_flat_gradient)
            for records in records_by_group]
        self._buffer_of: dict[int, tuple[FlatBuffer, int]] = {
            id(r.param): (b, i) for b in self.buffers for i, r in enumerate(b.records)}
        self.name: str = user_class_name(self.modules[0])
        """Its FQN once a root knows it."""
        self.ties: list[Any] = []
        """Tied parameters it lends or borrows (``runtime/tied.py``)."""
        self.set_reshard_after_forward(reshard_after_forward)

        # The model (set at lazy init)
        self.is_root: bool = False
        self.prefetch_order: Optional[PrefetchOrder[Unit]] = None
        self.collectives: Optional[CollectiveQueue] = None
        self.path: Optional[CollectivePath] = None
        """``unit_paths.py``, chosen per model."""
        self.layout_changed: Callable[[], None] = lambda: None
        """Set by the state."""

        # Per-iteration state
        self.training_state: TrainingState = TrainingState.IDLE
        self._modules_to_run: set[nn.Module] = set()
        """Modules yet to finish forward in this pass."""
        self._backward_possible: bool = False
        """Some output of the current forward pass requires grad."""
        self.backward_without_hook: bool = False
        """[Note: the local path]."""
        self.backward_started: Callable[[], None] = lambda: None
        """Set by the state."""
        self._saved_guard: Optional[saved_tensors_hooks] = None
        self._frozen_uses: int = 0
        """Pending frozen reads; -1: keep."""
        self.tied_holds: int = 0
        """Running forwards of borrowers of its tied parameters."""

    def set_reshard_after_forward(self, value: Union[bool, int, None]) -> None:
        """``None``, a bool, or ``k`` dividing ``F`` (collective when ``1 < k < F``)."""
        if value is None or isinstance(value, bool):
            self.settings.change("reshard_after_forward", value)
            self.settings.change("post_forward_group", None)
            return
        shard_size = self.group.world_size
        other = next((b for b in self.buffers if b.group is not self.group), None)
        if 1 < value < shard_size and other is not None:
            raise ValueError(
                f"reshard_after_forward={value} for {self.name}: parameter "
                f"'{other.records[0].fqn}' is sharded over another mesh (shard_placement_fn), "
                "and an int keeps the parameters sharded over a sub-group of the unit's mesh. "
                "Pass True or False, or annotate those parameters as a unit of their own.")
        if value < 1 or shard_size % value:
            divisors = [d for d in range(1, shard_size + 1) if shard_size % d == 0]
            raise ValueError(
                f"reshard_after_forward={value} for {self.name}: an int is the number of ranks "
                f"the parameters stay sharded over after forward and must divide the shard "
                f"group size {shard_size} (one of {divisors}; e.g. the ranks of one node). Pass "
                "True, False or one of those.")
        self.settings.change("reshard_after_forward", value != 1)
        self.settings.change("post_forward_group", post_forward_group(self.group, value)
                             if 1 < value < shard_size else None)

    def cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        dtype = self.settings.mp_policy.param_dtype
        if dtype is None or not self.settings.mp_policy.cast_forward_inputs:
            return args, kwargs
        return map_floating_tensors((args, kwargs), lambda t: t.to(dtype))

    def cast_output(self, output: Any) -> Any:
        dtype = self.settings.mp_policy.output_dtype
        return output if dtype is None else map_floating_tensors(output, lambda t: t.to(dtype))

    # --------------------------------------------------------------- queries
    def buffers_by_group(self) -> list[tuple[ShardGroup, list[int]]]:
        """Buffer indices per shard group."""
        by_group: dict[int, tuple[ShardGroup, list[int]]] = {}
        for index, buffer in enumerate(self.buffers):
            by_group.setdefault(id(buffer.group), (buffer.group, []))[1].append(index)
        return list(by_group.values())

    def locate(self, param: torch.Tensor) -> Optional[tuple[FlatBuffer, int]]:
        """``param``'s buffer and index there, or ``None``."""
        return self._buffer_of.get(id(param))

    @property
    def resolved_reshard_after_forward(self) -> bool:
        if self.settings.reduce_scatter_unused_params:
            return False
        if self.settings.reshard_after_forward is None:
            return not self.is_root
        return self.settings.reshard_after_forward

    @property
    def is_unsharded(self) -> bool:
        return any(b.is_unsharded for b in self.buffers)

    @property
    def backward_possible(self) -> bool:
        return self._backward_possible

    @property
    def trainable_buffers(self) -> list[FlatBuffer]:
        return [b for b in self.buffers if b.requires_grad]

    @property
    def frozen_buffers(self) -> list[FlatBuffer]:
        return [b for b in self.buffers if not b.requires_grad]

    def check_materialized(self) -> None:
        for buffer in self.buffers:
            if buffer.is_meta:
                raise RuntimeError(
                    f"parameter '{buffer.records[0].fqn}' of {self.name} is still on the meta "
                    "device at forward. Call fsdp_compose.materialize(model) (or "
                    "model.to_empty(device=...) and initialise the parameters) after fully_shard, "
                    "before the first forward.")

    # ----------------------------------------------------------- transitions
    def unshard(self) -> None:
        self.path.unshard(self)

    def reshard(self) -> None:
        for buffer in self.buffers:
            self.reshard_buffer(buffer)

    def reshard_buffer(self, buffer: FlatBuffer, keep: Optional[ShardGroup] = None) -> None:
        """After completing an unused prefetch into it."""
        if buffer.is_gathering:
            self.collectives.wait_gather(buffer)
        buffer.reshard(keep)

    def custom_comms(self) -> UnitComms:
        """Made at the first setter needing it."""
        comms = self.settings.comms
        if comms is None:
            comms = UnitComms()
            self.settings.change("comms", comms)
            for buffer in self.buffers:
                buffer.wire = CustomWire(comms, buffer.wire)
            self.layout_changed()
        return comms

    def rebuild_after_conversion(self) -> None:
        """After ``module.to(dtype)``."""
        for buffer in self.buffers:
            buffer.rebuild_after_conversion()
        self.layout_changed()

    def backward_pending_without_hook(self) -> bool:
        """[Note: the local path]."""
        return self.path.backward_pending_without_hook(self)

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.path.in_backward(self):
            # recomputation in backward
            self.unshard()
            for buffer in self.buffers:
                buffer.use_unsharded_views()
            return
        if not self._modules_to_run:  # a new pass
            self._modules_to_run.update(self.modules)
            self._backward_possible = False
        self.training_state = TrainingState.FORWARD
        self.path.gather_for_forward(self)
        if torch.is_grad_enabled():
            if self._saved_guard is not None or not self.settings.unshard_in_backward:
                self._guard_saved_parameters()
            frozen = False
            for buffer in self.buffers:
                if not buffer.start_recorded_forward():  # see [Note: storage and autograd]
                    frozen = True
            if frozen:
                self._register_frozen_post_backward(args, kwargs)
            self.path.start_forward(self, frozen)

    def post_forward(self, module: nn.Module, output: Any, pre_backward: Callable[[Any], None],
                     pass_ends: bool) -> bool:
        """Hook ``pre_backward`` on the output; whether the pass is complete."""
        if self.path.in_backward(self):
            return False  # recomputation inside backward: stay unsharded
        if self._saved_guard is not None:
            self._release_saved_guard()
        if torch.is_grad_enabled():
            tensors: Sequence[torch.Tensor]
            if type(output) is torch.Tensor:  # no walk
                tensors = (output,) if output.requires_grad else ()
            else:
                tensors = tensors_requiring_grad(output)
            if tensors:
                self._backward_possible = True
                self.path.hook_outputs(self, tensors, pre_backward)
        self._modules_to_run.discard(module)
        if self._modules_to_run and not pass_ends:
            return False  # a sibling module runs later
        self.complete_forward()
        return True

    def complete_forward(self) -> None:
        self._modules_to_run.clear()
        self.training_state = TrainingState.IDLE
        if self.tied_holds:
            pass  # the borrower reshards (runtime/tied.py)
        elif not self._backward_possible:
            self.reshard()
        elif self.resolved_reshard_after_forward:
            keep = self.settings.post_forward_group if self.settings.unshard_in_backward else None
            self.path.reshard_after_forward(self, keep)
        for buffer in self.buffers:
            buffer.check_params_unmodified()  # raises on every rank alike

    def release_after_tied_use(self, keep: bool) -> None:
        """The last borrower of a tied parameter finished its forward: reshard
        as this unit's own forward end would, unless ``keep``."""
        if self.tied_holds or keep or self.training_state is not TrainingState.IDLE:
            return
        if self._backward_possible and not self.resolved_reshard_after_forward:
            return  # its own policy keeps them
        self.path.reshard_after_forward(self, None)

    def _guard_saved_parameters(self) -> None:
        """With ``unshard_in_backward`` off, raise if forward saves a parameter."""
        self._release_saved_guard()
        if self.settings.unshard_in_backward:
            return
        storages = set().union(*(b.unsharded_storage_ptrs() for b in self.buffers))

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.untyped_storage().data_ptr() in storages:
                raise RuntimeError(
                    f"unit {self.name} has set_unshard_in_backward(False), but its forward saves "
                    f"a parameter (shape {tuple(tensor.shape)}) for backward, which would then "
                    "read freed memory. Only units whose backward reads no parameter values "
                    "(e.g. nn.Embedding) may skip the backward all-gather; call "
                    "set_unshard_in_backward(True) on this module.")
            return tensor

        self._saved_guard = saved_tensors_hooks(pack, lambda tensor: tensor)
        self._saved_guard.__enter__()

    def _release_saved_guard(self) -> None:
        if self._saved_guard is not None:
            guard, self._saved_guard = self._saved_guard, None
            guard.__exit__(None, None, None)

    def pre_backward(self) -> None:
        """At most once per backward."""
        if self.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
            return
        self.training_state = TrainingState.PRE_BACKWARD
        if self.settings.unshard_in_backward:
            self.path.gather_for_backward(self)

    def _post_backward(self, buffer: FlatBuffer) -> None:
        """``buffer``'s flat gradient is complete."""
        self.path.gradient_ready(self)
        if profiler_active():
            call_profiled("post_backward", self.name, self._reduce_and_reshard, buffer)
        else:
            self._reduce_and_reshard(buffer)

    def _before_flat_gradient(self, buffer: FlatBuffer) -> None:
        """Before a reduced gradient is allocated."""
        settings = self.settings
        if self.collectives is not None and settings.requires_gradient_sync and \
                not settings.reduce_scatter_unused_params:
            self.collectives.make_room_for_reduce()

    def _reduce_and_reshard(self, buffer: FlatBuffer) -> None:
        settings = self.settings
        if settings.requires_gradient_sync and settings.reduce_scatter_unused_params:
            pass  # reduced at the end of backward (reduce_deferred)
        elif settings.requires_gradient_sync:
            self.path.reduce(buffer, settings.reduce_options)
        else:
            buffer.grad.stash_unreduced()
        if settings.reshard_after_backward:
            if buffer.is_gathering:
                self.collectives.wait_gather(buffer)
            buffer.reshard()
        self.training_state = TrainingState.POST_BACKWARD

    def _register_frozen_post_backward(self, args: tuple, kwargs: dict) -> None:
        """Frozen buffers (no gradient hook) reshard once every call's input
        gradients are computed."""
        if self._frozen_uses < 0:
            return
        inputs = tensors_requiring_grad((args, kwargs))
        if not inputs:
            self._frozen_uses = -1
            return
        self._frozen_uses += 1
        me = weakref.ref(self)  # see FullyShardState.bind

        def use_done(_grads: Any) -> None:
            unit = me()
            if unit is not None:
                unit._frozen_use_done()
        register_multi_grad_hook(inputs, use_done, mode="all")

    def _frozen_use_done(self) -> None:
        if self._frozen_uses <= 0:
            return
        self._frozen_uses -= 1
        if self._frozen_uses == 0 and self.training_state is not TrainingState.IDLE \
                and self.settings.reshard_after_backward:
            for buffer in self.frozen_buffers:
                self.reshard_buffer(buffer)

    def finish_backward(self) -> None:
        """Reshard per policy; IDLE after."""
        if self.training_state is not TrainingState.FORWARD:
            reshard = self.settings.reshard_after_backward
            for buffer in self.buffers:
                if reshard and (buffer.is_unsharded or buffer.is_gathering):
                    self.reshard_buffer(buffer)
                buffer.drop_post_forward_copy()
            self._frozen_uses = 0
        self.training_state = TrainingState.IDLE

    def reset_iter_state(self) -> None:
        """After an iteration raised. Post-condition: IDLE, sharded, nothing in flight."""
        self._release_saved_guard()
        for buffer in self.buffers:
            if self.collectives is not None:
                self.collectives.discard_buffer(buffer)
            buffer.grad.discard_iteration()
            buffer.reshard()
        self.training_state = TrainingState.IDLE
        self._modules_to_run.clear()
        self._backward_possible = False
        self._frozen_uses = 0
        self.tied_holds = 0

    def __repr__(self) -> str:
        return f"Unit({self.name}, buffers={self.buffers})"

