"""The methods every module annotated by ``fully_shard`` gains.

The module's class becomes a dynamic subclass of its own class and
:class:`ShardedModule`; the methods have FSDP2's names and meaning and route
to the ``FullyShardState`` of the module or of every unit below it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence, Union

import torch
import torch.nn as nn

from .._torch_private import require_override
from ..checks.ddp_wrapper import ddp_around_annotated
from ..checks.finite import check_finite_gradients
from ..gradients.clip import clip_grad_norm_
from ..comm.rendezvous import arrive
from ..policies import PrefetchPolicy
from .comm_methods import ShardedCommMethods
from .finalization_methods import ShardedFinalizationMethods
from .manual_finalization import drop_pending_gradients
from ..runtime.state import FullyShardState, state_of, states_below
from ..runtime.buckets import cap_bytes
from .._naming import USER_CLASS_ATTR
from ..runtime.tensors import swapping_params_on_conversion
from ..runtime.unit import Unit


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``; ``wait()`` finishes the
    all-gathers and switches the modules to the full views."""

    def __init__(self, units: list[Unit]) -> None:
        self._units = units

    def wait(self) -> None:
        for unit in self._units:
            unit.collectives.wait_gathers(unit)
        self._units = []


class ShardedModule(ShardedCommMethods, ShardedFinalizationMethods):
    """Methods mixed into every module annotated by :func:`fully_shard`
    (``fsdp_compose.FSDPModule``); collective settings are in
    ``comm_methods.py``, manual finalization in ``finalization_methods.py``."""

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        # the first attribute DistributedDataParallel's constructor reads (checks/ddp_wrapper.py)
        raise ddp_around_annotated(self)

    def unshard(self, async_op: bool = False, *, recurse: bool = False) -> Optional[UnshardHandle]:
        """All-gather this unit's parameters (with ``recurse=True``, every
        unit's below it too); until :meth:`reshard` the module attributes hold
        the full parameters. ``async_op=True`` returns an
        :class:`UnshardHandle` to ``wait()`` on. Call it on every rank."""
        own = _own_state(self)
        arrive(own.unit.group.process_group, f"unshard() of {own.unit.name}",
               "Call it on every rank (it all-gathers); to inspect full weights on one "
               "rank, unshard on every rank and read them there.")
        own.lazy_init()
        units = [state.unit for state in _states(self, recurse)]
        for unit in units:
            unit.collectives.start_unshard(unit, unit.training_state)
        handle = UnshardHandle(units)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self, *, recurse: bool = False) -> None:
        """Free the unsharded parameters; attributes are the sharded
        ``nn.Parameter`` objects again."""
        for state in _states(self, recurse):
            state.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """With ``False``, backward keeps the gradients unreduced (no
        collectives); the next backward with ``True`` reduces their sum."""
        for state in _states(self, recurse):
            state.change_unit_setting("requires_gradient_sync", requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's gradient-accumulation context: inside, every unit below
        this module keeps its gradients unreduced; on exit each unit's
        previous setting returns."""
        states = _states(self, True)
        previous = [state.unit.settings.requires_gradient_sync for state in states]
        for state in states:
            state.change_unit_setting("requires_gradient_sync", False)
        try:
            yield
        finally:
            for state, setting in zip(states, previous):
                state.change_unit_setting("requires_gradient_sync", setting)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """With ``False``, units stay unsharded after backward (saving the
        next forward's all-gather). Set ``True`` (or ``reshard()``) before the
        optimizer step, which updates the shards, not the unsharded copy."""
        for state in _states(self, recurse):
            state.change_unit_setting("reshard_after_backward", reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: Sequence[nn.Module]) -> None:
        """Before this module's forward, all-gather ``modules`` (annotated)
        instead of the next unit in the recorded order."""
        _own_state(self).change_unit_setting("forward_prefetch",
                                             [_own_state(m).unit for m in modules])

    def set_modules_to_backward_prefetch(self, modules: Sequence[nn.Module]) -> None:
        """When this module's backward starts, all-gather ``modules``
        instead of the next unit in the recorded order."""
        _own_state(self).change_unit_setting("backward_prefetch",
                                             [_own_state(m).unit for m in modules])

    def set_prefetch_policy(self, policy: PrefetchPolicy) -> None:
        """Set the prefetch policy of the whole model (meant for the root;
        set on two modules with different values, the root's first forward
        raises). ``TypeError`` unless ``policy`` is a ``PrefetchPolicy``."""
        if not isinstance(policy, PrefetchPolicy):
            raise TypeError(f"expected a PrefetchPolicy, got {type(policy).__name__}")
        _own_state(self).change_model_setting("prefetch_policy", policy)

    def set_bucket_cap_mb(self, bucket_cap_mb: float) -> None:
        """Gather and reduce consecutive units (forward order) of at most
        ``bucket_cap_mb`` MiB unsharded together, in buckets of at most that size,
        for the whole model (default ``DEFAULT_BUCKET_CAP_MB``, 2; ``0``: off).
        Same numbers bit for bit. Call it on every rank; it applies from the next
        root forward after the two verified first steps."""
        cap = float(bucket_cap_mb)
        cap_bytes(cap, where=f"set_bucket_cap_mb on {_own_state(self).unit.name}: ")
        _own_state(self).change_model_setting("bucket_cap_mb", cap)

    def set_reshard_after_forward(self, reshard_after_forward: Union[bool, int],
                                  recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` (a bool, or an int: shard over
        that many ranks between forward and backward, see :func:`fully_shard`)
        on every unit below this module (``recurse=False``: its own only).
        ``True`` makes the root reshard too. Call it on every rank."""
        check_reshard_after_forward(reshard_after_forward)
        for state in _states(self, recurse):
            state.unit.set_reshard_after_forward(reshard_after_forward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """With ``False``, this unit's backward does not all-gather again:
        only for units whose backward reads no parameter (``nn.Embedding``).
        A forward that saves a parameter for backward then raises."""
        _own_state(self).change_unit_setting("unshard_in_backward", unshard_in_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """With ``False``, the end of backward neither waits for the
        reduce-scatters nor publishes ``.grad``: more backwards of this step
        follow. Set ``True`` before the step's last backward. Applies to the
        whole model."""
        _own_state(self).change_model_setting("is_last_backward", bool(is_last_backward))

    def set_gradient_divide_factor(self, factor: float, *, recurse: bool = True) -> None:
        """Reduce gradients as the sum over ranks divided by ``factor``
        (> 0, else ``ValueError``) instead of the mean; ``1.0`` sums. Applies
        to every unit below this module (``recurse=False``: its own only, as
        FSDP2)."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be > 0, got {factor}")
        for state in _states(self, recurse):
            state.change_unit_setting("divide_factor", float(factor))

    def set_force_sum_reduction_for_comms(self, enable: bool, *, recurse: bool = True) -> None:
        """With ``True``, collectives only ``SUM`` and the division happens
        locally; same gradients. Applies to every unit below this module
        (``recurse=False``: its own only)."""
        for state in _states(self, recurse):
            state.change_unit_setting("force_sum", bool(enable))

    def reset_iter_state(self) -> None:
        """Recover from an exception that aborted a forward or backward on every
        rank. Call it on the root before the next iteration::

            try:
                model.loss(x, y).backward()
            except SomeError:
                model.reset_iter_state()
                optim.zero_grad()

        Waits for the collectives in flight, reshards every unit and clears the
        iteration's state. ``.grad`` keeps what earlier iterations published,
        possibly plus a reduction completed before the exception: zero it.
        Uncalled, the root's next forward does it with a warning;
        ``optimizer.step()`` before either raises."""
        _own_state(self).reset_iter_state()

    def set_check_finite_gradients(self, enabled: bool) -> None:
        """With ``True`` (default off), every last backward checks the model's
        gradients and raises ``RuntimeError`` on every rank naming the first
        parameter holding a nan or inf on some rank (one all-reduce and host sync
        per step). The model stays usable: zero the gradients, skip the step."""
        _own_state(self).change_model_setting(
            "after_last_backward", check_finite_gradients if enabled else None)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """With ``True``, every rank reduces all of these units' gradients in every
        synced backward (zero where its backward gave none), so a unit reaching
        the loss on some ranks only (mixture of experts) stays correct. The units
        stay unsharded until the end of backward, where they reduce. Parameters
        no rank used keep ``.grad is None``. Every rank must still run every
        unit's forward."""
        for state in _states(self, recurse):
            state.change_unit_setting("reduce_scatter_unused_params",
                                      bool(reduce_scatter_unused_params))

    def set_check_rank_divergence(self, enable: Optional[bool]) -> None:
        """Whether to verify before every collective that all ranks issue it for
        the same unit (one small blocking all-gather each), raising on every rank
        with what each was about to run. ``None`` (default): for the first two
        training iterations (and at most 8 root forwards without gradients),
        or always with ``FSDP_COMPOSE_CHECK_ORDER=1``;
        ``True``: always; ``False``: never, and no [Note: forward agreement]
        either. Call it on the root; it applies from its next forward. Anything
        else raises ``TypeError``. See [Note: rank divergence]."""
        if enable is not None and not isinstance(enable, bool):
            raise TypeError(f"set_check_rank_divergence expects a bool or None, got {enable!r}")
        _own_state(self).change_model_setting("check_rank_divergence", enable)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip this module's gradients by their total norm over all ranks
        and return that norm (:func:`fsdp_compose.clip_grad_norm_`)."""
        return clip_grad_norm_(self, max_norm, norm_type)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, also dropping gradients not yet reduced;
        with ``set_to_none`` (default) the freed gradient memory is given
        back at once rather than at the next forward."""
        super().zero_grad(set_to_none)  # type: ignore[misc]
        drop_pending_gradients([state.unit for state in states_below((self,))])
        if set_to_none:
            for state in states_below((self,)):
                for buffer in state.unit.buffers:
                    buffer.grad.release_if_free()

    def __new__(cls, *args, **kwargs):
        # ``self.__class__(...)`` (nn.Sequential slicing) builds a plain module
        # of the original class: a fresh module has no fully_shard state.
        # (MRO: Sharded<X>, ShardedModule, its bases but object, X, ...)
        original = cls.__mro__[len(ShardedModule.__mro__)]
        module = original.__new__(original)
        module.__init__(*args, **kwargs)
        return module

    def __copy__(self):
        self.__deepcopy__({})

    def __deepcopy__(self, memo: dict):
        raise TypeError(
            f"cannot copy a {type(self).__name__} annotated by fully_shard: the copy would share "
            "its hooks and flat buffers with the original. Copy the model before fully_shard, "
            "or build a new one and load a state_dict into it.")

    def __reduce_ex__(self, protocol: int):
        raise TypeError(
            f"cannot pickle (torch.save) a {type(self).__name__} annotated by fully_shard: each "
            "rank holds only its shards. Save a state_dict instead (model.state_dict() or "
            "torch.distributed.checkpoint, on every rank), or copy/save the model before "
            "fully_shard.")

    def _apply(self, fn, recurse: bool = True):
        """``module.to(dtype)`` and kin: convert the shards and rebuild each
        unit's flat buffers (parameters keep their identity)."""
        if _converting:
            # an enclosing _apply rebuilds every unit once all are converted
            # (a unit may span modules this call does not convert)
            return super()._apply(fn, recurse)  # type: ignore[misc]
        units = [state.unit for state in _states(self, recurse=True)]
        for unit in units:
            unit.reshard()
        # leaving the meta device needs swap_tensors to keep Parameter identity
        leaving_meta = any(buffer.is_meta for unit in units for buffer in unit.buffers)
        _converting.append(self)
        try:
            with swapping_params_on_conversion(leaving_meta):
                result = super()._apply(fn, recurse)  # type: ignore[misc]
        finally:
            _converting.pop()
        for unit in units:
            unit.rebuild_after_conversion()
        return result


# nn.Module._apply is private: a renamed one would skip the override above
require_override(nn.Module, "_apply", "converting the shards of annotated modules (module.to())")

FSDPModule = ShardedModule
"""FSDP2's name for :class:`ShardedModule`."""


def share_comm_ctx(modules: Sequence[nn.Module]) -> None:
    """FSDP2's stream sharing between roots: collectives here run on the
    current stream, so this only checks that every module is annotated
    (``ValueError`` otherwise)."""
    for module in modules:
        if not isinstance(module, ShardedModule):
            raise ValueError(f"Expects list of FSDPModules (modules annotated by fully_shard) "
                             f"but got {type(module).__name__}")


_SHARDED_CLASSES: dict[type, type] = {}
_converting: list[nn.Module] = []
"""The outermost ``ShardedModule._apply`` in progress (empty: none)."""


def sharded_class(cls: type) -> type:
    """The dynamic subclass of ``cls`` and :class:`ShardedModule` (one per class)."""
    if issubclass(cls, ShardedModule):
        return cls
    if cls not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedModule, cls),
                                     {"__module__": cls.__module__, USER_CLASS_ATTR: cls})
    return _SHARDED_CLASSES[cls]


def _own_state(module: nn.Module) -> FullyShardState:
    state = state_of(module)
    if state is None:
        raise AssertionError(f"{type(module).__name__} has no fully_shard state")
    return state


def _states(module: nn.Module, recurse: bool) -> list[FullyShardState]:
    return states_below((module,)) if recurse else [_own_state(module)]


def check_reshard_after_forward(value: object) -> None:
    """Type check only; ``Unit.set_reshard_after_forward`` checks an int."""
    if value is None or isinstance(value, (bool, int)):
        return
    raise TypeError(
        f"reshard_after_forward must be a bool, an int or None, got {type(value).__name__}")
