"""The methods every module annotated by ``fully_shard`` gains.

``fully_shard`` makes the module's class a dynamic subclass of its own class
and :class:`ShardedModule` (``sharded_class``); the methods have FSDP2's
names and meaning, duck-typed (annotated modules are not torch's
``FSDPModule``). Each one routes to the ``FullyShardState`` of the module or of
every unit in its subtree.
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
    """Returned by ``unshard(async_op=True)``: the all-gathers are in flight;
    ``wait()`` finishes them and switches the modules to the full views."""

    def __init__(self, units: list[Unit]) -> None:
        self._units = units

    def wait(self) -> None:
        for unit in self._units:
            unit.collectives.wait_gathers(unit)
        self._units = []


class ShardedModule(ShardedCommMethods, ShardedFinalizationMethods):
    """Methods mixed into every module annotated by :func:`fully_shard`
    (the module's class becomes a subclass of its own class and this one);
    those that change the collectives are in ``comm_methods.py``,
    those that finalize backward by hand or keep unsharded storage in
    ``finalization_methods.py``.
    ``fsdp_compose.FSDPModule`` is this class."""

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        # the first attribute DistributedDataParallel's constructor reads (checks/ddp_wrapper.py)
        raise ddp_around_annotated(self)

    def unshard(self, async_op: bool = False, *, recurse: bool = False) -> Optional[UnshardHandle]:
        """All-gather this unit's parameters (and every unit below it with
        ``recurse=True``); until :meth:`reshard`, each original parameter's
        module attribute holds the full values in the original shape."""
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
        """With ``False``, backward keeps the unsharded flat gradients (no
        collectives) and the next backward with ``True`` reduces their sum."""
        for state in _states(self, recurse):
            state.change_unit_setting("requires_gradient_sync", requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's and FSDP1's gradient-accumulation context: inside, every
        unit at or below this module keeps its gradients unreduced; on exit
        each unit's previous setting returns (the next backward outside
        reduces the accumulated sum). What accelerate's ``no_sync`` calls."""
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
        next forward's all-gather during accumulation). Set it back to
        ``True`` (or call ``reshard()``) before the optimizer step: the
        optimizer updates the shards, not the unsharded copy."""
        for state in _states(self, recurse):
            state.change_unit_setting("reshard_after_backward", reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: Sequence[nn.Module]) -> None:
        """Before this module's forward, issue the all-gathers of ``modules``
        (annotated modules) instead of the one chosen by the recorded order."""
        _own_state(self).change_unit_setting("forward_prefetch",
                                             [_own_state(m).unit for m in modules])

    def set_modules_to_backward_prefetch(self, modules: Sequence[nn.Module]) -> None:
        """When this module's backward starts, issue the all-gathers of
        ``modules`` instead of the one chosen by the recorded order."""
        _own_state(self).change_unit_setting("backward_prefetch",
                                             [_own_state(m).unit for m in modules])

    def set_prefetch_policy(self, policy: PrefetchPolicy) -> None:
        """Set forward/backward prefetch and the in-flight limits for the
        whole model this module belongs to (meant for the root; made on
        another module before the first forward, the root applies it to the
        whole model, and different values on two modules raise there)."""
        if not isinstance(policy, PrefetchPolicy):
            raise TypeError(f"expected a PrefetchPolicy, got {type(policy).__name__}")
        _own_state(self).change_model_setting("prefetch_policy", policy)

    def set_bucket_cap_mb(self, bucket_cap_mb: float) -> None:
        """Coalesce the collectives of consecutive small units, for the whole
        model this module belongs to: units of at most ``bucket_cap_mb`` MiB
        unsharded, consecutive in the forward order, are gathered by one
        all-gather and reduced by one reduce-scatter, in buckets of at most
        that size (default ``DEFAULT_BUCKET_CAP_MB``, 2; ``0`` turns
        bucketing off). Same numbers bit for bit; see ``runtime/buckets.py``
        and docs/performance.md. Every rank must call it at the same point.
        Takes effect at the next root forward (the buckets follow the
        forward order of the last step the ranks agreed on; the verified
        first two steps run unbucketed); made before the first forward, the
        root applies it (like :meth:`set_prefetch_policy`)."""
        cap = float(bucket_cap_mb)
        cap_bytes(cap, where=f"set_bucket_cap_mb on {_own_state(self).unit.name}: ")
        _own_state(self).change_model_setting("bucket_cap_mb", cap)

    def set_reshard_after_forward(self, reshard_after_forward: Union[bool, int],
                                  recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` (``True`` makes the root reshard
        after forward too, and all-gather again for backward; an int keeps
        the parameters sharded over that many ranks between forward and
        backward, see :func:`fully_shard`) on every unit of this subtree
        (``recurse=False``: this module's unit only; positional as in
        FSDP2). Call it on every rank."""
        check_reshard_after_forward(reshard_after_forward)
        for state in _states(self, recurse):
            state.unit.set_reshard_after_forward(reshard_after_forward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """With ``False``, this unit's backward does not all-gather its
        parameters again: only for units whose backward reads no parameter
        values, e.g. an ``nn.Embedding`` (its weight gradient needs only the
        indices). A forward that saves a parameter for backward raises."""
        _own_state(self).change_unit_setting("unshard_in_backward", unshard_in_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """With ``False``, the end of backward neither waits for the
        reduce-scatters still in flight nor hands the gradients to the
        parameters: more backwards of this step follow (micro-batches,
        pipeline schedules). Set ``True`` before the step's last backward.
        A setting of the model (its end of backward reads it): made on any
        of its annotated modules, it applies to the whole model."""
        _own_state(self).change_model_setting("is_last_backward", bool(is_last_backward))

    def set_gradient_divide_factor(self, factor: float, *, recurse: bool = True) -> None:
        """Reduce gradients as the sum over ranks divided by ``factor``
        instead of the mean (``factor=1.0``: summed gradients, for a loss
        that is already normalised globally). Applies to every unit of this
        module's subtree (``recurse=False``: this module's unit only, which
        is what FSDP2's method, without ``recurse``, always does)."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be > 0, got {factor}")
        for state in _states(self, recurse):
            state.change_unit_setting("divide_factor", float(factor))

    def set_force_sum_reduction_for_comms(self, enable: bool, *, recurse: bool = True) -> None:
        """With ``True``, collectives only ever ``SUM`` (the division by the
        world size or the divide factor happens locally afterwards); the
        gradients are the same. Applies to every unit of this subtree
        (``recurse=False``: this module's unit only, as FSDP2's method)."""
        for state in _states(self, recurse):
            state.change_unit_setting("force_sum", bool(enable))

    def reset_iter_state(self) -> None:
        """Recover from an exception that aborted a forward or backward
        midway on every rank (e.g. in the loss function, or inside a
        module's forward or backward). Call it on the root, after catching
        the exception and before the next iteration::

            try:
                model.loss(x, y).backward()
            except SomeError:
                model.reset_iter_state()   # then go on with the next batch
                optim.zero_grad()

        It waits for the all-gathers and reduce-scatters still in flight
        (every rank issued the same ones before raising), reshards every
        unit (the modules hold the original parameters again), and clears
        the iteration's state: training states back to IDLE, the partial
        forward order (prefetch keeps following the last complete
        iteration), unreduced gradients and no-sync accumulation, pending
        reductions, used-parameter flags, frozen-parameter counters, the
        saved-tensor guard and the queued end-of-backward flag. The failed
        iteration's gradients are dropped; ``.grad`` keeps what earlier
        iterations published (a reduction that completed before the
        exception may already be added to it when gradients were being
        accumulated across steps: zero them). If it is not called, the
        root's next forward does it, with a warning; ``optimizer.step()``
        before either raises."""
        _own_state(self).reset_iter_state()

    def set_check_finite_gradients(self, enabled: bool) -> None:
        """With ``True``, the end of every last backward checks the
        gradients of the whole model (a setting of the model: call it on
        any of its annotated modules, the root's being the clearest) and raises ``RuntimeError`` on every
        rank naming the first parameter (``named_parameters()`` order)
        whose gradient holds a nan or inf on some rank. Costs a max-abs per
        gradient, one all-reduce of one integer and one host sync per
        step; nothing when off (the default). The model is usable after
        the error: zero the gradients and skip the step. See
        :func:`fsdp_compose.check_finite_gradients` to check on demand."""
        _own_state(self).change_model_setting(
            "after_last_backward", check_finite_gradients if enabled else None)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """With ``True``, every rank reduces every trainable buffer of these
        units in every backward with gradient sync, with a zero gradient
        where its backward gave none, so a unit whose output reaches the loss
        on some ranks only (mixture of experts, multi-modal branches) is
        correct instead of pairing mismatched collectives (FSDP2's name).

        The reductions are deferred to the end of backward, in unit order,
        and the units stay unsharded from forward to the end of backward (no
        backward all-gather, which only the ranks that use the unit would
        issue): use it on the units whose use is rank-dependent. Parameters
        no rank used still get ``.grad is None``. Every rank must still run
        every unit's *forward*; forward-side divergence is detected, not
        fixed (see ``set_check_rank_divergence``)."""
        for state in _states(self, recurse):
            state.change_unit_setting("reduce_scatter_unused_params",
                                      bool(reduce_scatter_unused_params))

    def set_check_rank_divergence(self, enable: Optional[bool]) -> None:
        """Whether to verify, before every collective of every iteration,
        that all ranks issue it for the same unit (one tiny blocking
        all-gather per collective), raising on every rank with the units
        each rank was about to run. ``None`` (default): until the ranks
        have verified the end of two last backwards together (the first two
        training iterations, with any evaluation forward among them; at most
        8 root forwards without gradients), or every iteration when the
        environment variable ``FSDP_COMPOSE_CHECK_ORDER=1`` is set;
        ``False``: never, and no forward agreement either (the store
        meeting that starts every root forward, [Note: forward agreement]:
        an evaluation on one rank then ends in gloo's abort). Call it on
        the root; it takes effect at the next forward of the root. The
        end-of-backward fingerprint check is always on (no extra
        collective). See [Note: rank divergence] in ``checks/divergence.py``.
        Made on another module before the first forward, the root applies it
        to the whole model (different values on two modules raise there)."""
        if enable is not None and not isinstance(enable, bool):
            raise TypeError(f"set_check_rank_divergence expects a bool or None, got {enable!r}")
        _own_state(self).change_model_setting("check_rank_divergence", enable)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every parameter of this module by their
        total norm over all ranks, like FSDP1's method (torch's
        ``nn.utils.clip_grad_norm_`` would see only this rank's shards).
        Returns the total norm. See :func:`fsdp_compose.clip_grad_norm_`."""
        return clip_grad_norm_(self, max_norm, norm_type)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``; with ``set_to_none`` (the default) the
        memory of the sharded gradients it cleared is given back at once,
        where nothing else holds them, rather than at the next forward (as
        ``optimizer.zero_grad()`` does, see ``fsdp_compose/gradients/torch_zero_grad.py``).
        The gradients not yet reduced (``get_pending_gradients``) are dropped
        too, as one process drops what it accumulated."""
        super().zero_grad(set_to_none)  # type: ignore[misc]
        drop_pending_gradients([state.unit for state in states_below((self,))])
        if set_to_none:
            for state in states_below((self,)):
                for buffer in state.unit.buffers:
                    buffer.grad.release_if_free()

    def __new__(cls, *args, **kwargs):
        # Constructing the sharded class (nn.Sequential slicing does
        # ``self.__class__(...)``) gives a plain module of the original class:
        # a fresh module has no fully_shard state.
        # (Sharded<X>, ShardedModule, its bases but object, X, ...)
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
        """``module.to(dtype)``, ``.double()``, ``.bfloat16()``, ...: convert
        the shards, and rebuild each unit's flat buffers in the new dtype
        (parameters keep their identity, ``.grad`` follows)."""
        if _converting:
            # an enclosing module's _apply recursed here: it rebuilds every unit below
            # it once all are converted (a sibling-list unit spans modules this call
            # does not convert, so rebuilding here would see them half converted)
            return super()._apply(fn, recurse)  # type: ignore[misc]
        units = [state.unit for state in _states(self, recurse=True)]
        for unit in units:
            unit.reshard()
        # Leaving the meta device (to_empty) cannot use `param.data = ...`; torch
        # would register new Parameter objects. swap_tensors keeps identity.
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


# nn.Module._apply is not public: a torch that renamed it would skip the override
# above (module.to(dtype) would convert views of the flat buffers, not the shards)
require_override(nn.Module, "_apply", "converting the shards of annotated modules (module.to())")

FSDPModule = ShardedModule
"""FSDP2's name: ``isinstance(module, FSDPModule)`` holds for every
module annotated by :func:`fully_shard`."""


def share_comm_ctx(modules: Sequence[nn.Module]) -> None:
    """FSDP2 makes several roots (pipeline stages) share its communication
    streams. The library issues every collective on the current stream and
    keeps no streams of its own, so the roots share them already: this only
    checks that every module is annotated (``ValueError`` otherwise, as FSDP2)."""
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
    """Type check only; an int is checked against the unit's shard group by
    :meth:`Unit.set_reshard_after_forward`."""
    if value is None or isinstance(value, (bool, int)):
        return
    raise TypeError(
        f"reshard_after_forward must be a bool, an int or None, got {type(value).__name__}")
