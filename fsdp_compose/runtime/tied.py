"""Tied parameters across units: one parameter registered in modules of two
units (a tied input embedding and output head in units of their own).

[Note: tied parameters across units]
The unit annotated first (the *owner*) holds the parameter; a later unit's
module registering it too (the *borrower*) becomes one more slot of the
owner's buffer (``FlatBuffer.add_slot``), as a weight tied inside one unit,
so one ``nn.Parameter`` stays registered in both modules. The borrowing
module's forward hooks unshard the owner (idempotent) and hold it until the
module's forward ends; a recorded forward makes the views node anew, so
every use's gradient reaches the owner's one flat gradient. Backward needs
no counting: autograd accumulates a leaf once, after every node feeding it,
so the owner's post-backward hook runs once with the sum. After the
borrowing forward the owner reshards as its own forward's end would, unless
either unit keeps its parameters for backward (one all-gather then serves
both). A borrower's all-gather is not prefetched.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook

from .._torch_private import current_graph_task_id
from ..buffers.flat_buffer import FlatBuffer
from .tensors import tensors_requiring_grad
from .training_state import TrainingState
from .unit import Unit


class TiedParameter:
    """Parameter ``index`` of ``owner``'s ``buffer``, also ``module.<attr>``
    where ``borrower`` manages ``module``; ``fqn`` and ``owner_fqn`` are its
    two names in the model."""

    __slots__ = ('owner', 'borrower', 'buffer', 'index', 'module', 'attr', 'fqn', 'owner_fqn',
                 '__weakref__')

    def __init__(self, owner: Unit, borrower: Unit, buffer: FlatBuffer, index: int,
                 module: nn.Module, attr: str, fqn: str, owner_fqn: str) -> None:
        self.owner: Unit = owner
        self.borrower: Unit = borrower
        self.buffer: FlatBuffer = buffer
        self.index: int = index
        self.module: nn.Module = module
        self.attr: str = attr
        self.fqn: str = fqn
        self.owner_fqn: str = owner_fqn

    # ---------------------------------------------------------------- hooks
    def pre_forward(self, is_held_whole: Callable[[], bool],
                    lazy_init: Callable[[], None]) -> None:
        """The borrowing forward starts: unshard the owner's buffer and hold it
        until :meth:`post_forward`."""
        if is_held_whole():
            return  # inside full_params: the parameters are whole already
        owner = self.owner
        if owner.collectives is None:
            lazy_init()  # the borrowing module runs before any forward of its root
        owner.tied_holds += 1
        owner.unshard()  # idempotent
        buffer = self.buffer
        if current_graph_task_id() != -1:  # recomputation inside backward
            buffer.use_unsharded_views()
        elif torch.is_grad_enabled():
            buffer.start_recorded_forward()  # this use's own views node
        else:
            buffer.use_unsharded_views()

    def post_forward(self, output: Any, is_held_whole: Callable[[], bool]) -> None:
        """The borrowing forward ended: hook its output for backward and release
        the owner's buffer."""
        if is_held_whole():
            return
        owner = self.owner
        owner.tied_holds -= 1
        if current_graph_task_id() != -1:
            return  # recomputation inside backward: the owner's post-backward reshards
        tensors = tensors_requiring_grad(output) if torch.is_grad_enabled() else []
        if tensors:
            me = weakref.ref(self)  # autograd keeps hooks in C++: no strong edge back

            def unshard_for_backward(_grads: Any) -> None:
                tie = me()
                if tie is not None:
                    tie.borrower.backward_started()  # the model's end of backward, once
                    tie.owner.unshard()
            register_multi_grad_hook(tensors, unshard_for_backward, mode="any")
        keep = bool(tensors) and not self.borrower.resolved_reshard_after_forward
        owner.release_after_tied_use(keep)
        if owner.training_state is TrainingState.IDLE:
            self.buffer.check_params_unmodified()  # may raise, on every rank alike

    def describe(self) -> str:
        return f"'{self.fqn}' is '{self.owner_fqn}' of {self.owner.name}"


def borrow(owner: Unit, borrower: Unit, buffer: FlatBuffer, index: int, module: nn.Module,
           attr: str, fqn: str, owner_fqn: str, is_held_whole: Callable[[], bool],
           lazy_init: Callable[[], None]) -> TiedParameter:
    """Register ``module.<attr>`` as one more slot of parameter ``index`` of
    ``owner``'s ``buffer`` and hook ``module``'s forward; both units record
    the tie. ``is_held_whole``: ``full_params`` holds the owner whole (hooks
    do nothing); ``lazy_init``: the borrower's root's.

    Pre-condition: the owner's buffer is sharded."""
    buffer.add_slot(index, module, attr)
    tie = TiedParameter(owner, borrower, buffer, index, module, attr, fqn, owner_fqn)
    owner.ties.append(tie)
    borrower.ties.append(tie)
    ref = weakref.ref(tie)

    def pre_forward(_module: nn.Module, _args: tuple) -> None:
        held = ref()
        if held is not None:
            held.pre_forward(is_held_whole, lazy_init)

    def post_forward(_module: nn.Module, _args: tuple, output: Any) -> None:
        held = ref()
        if held is not None:
            held.post_forward(output, is_held_whole)
    module.register_forward_pre_hook(pre_forward)
    module.register_forward_hook(post_forward)
    return tie
