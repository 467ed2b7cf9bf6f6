"""Tied parameters across units: one parameter registered in modules of two
units (a tied input embedding and output head in units of their own).

[Note: tied parameters across units]
The unit annotated first takes the parameter into its buffer (the *owner*;
annotating bottom-up, the one below); a later unit whose modules also hold
it (the *borrower*) does not take it again but borrows it: the owner's
buffer gets the borrowing module's attribute as one more slot
(``FlatBuffer.add_slot``), exactly as a weight tied inside one unit has two
slots, so that one ``nn.Parameter`` stays registered in both modules and
every unshard puts the same view in both. The borrowing module's forward
hooks unshard the owner through the owner's own path (``Unit.unshard``:
the collective queue makes it idempotent, so a buffer still unsharded is
not gathered again) and hold it (``Unit.tied_holds``) until the module's
forward ends; a forward that records a graph makes the buffer's views node
anew first (``FlatBuffer.start_recorded_forward``), so the gradients of
every use arrive through the owner's views into the owner's one flat
gradient.

Backward needs no counting of its own: every use's views node feeds the
same leaf (the owner's unsharded buffer), and autograd runs a leaf's
accumulation once per backward, after every node that feeds it, which is
after every node that reads the parameter. So the owner's post-backward
hook (reduce-scatter, then reshard) runs once, after the last use, with
the sum of all uses. The borrowing module's output carries a pre-backward
hook that unshards the owner again where its forward resharded it.

When the borrowing module's forward ends, the owner's buffer is resharded
as the end of the owner's forward would (``Unit.release_after_tied_use``),
except while the owner's forward or backward runs, where the owner keeps
its parameters for backward (``reshard_after_forward=False``, the root: then
one all-gather serves every use of the step), or where the borrower's
output will be differentiated and the borrower keeps its own parameters for
backward (the root): the borrower's backward, next, would gather it again
(one all-gather serves the head's forward and backward). The all-gather a
borrowing module issues is not prefetched.
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
    """Parameter ``index`` of ``owner``'s ``buffer``, also registered as
    ``module.<attr>`` where ``module`` is managed by ``borrower``.

    Attributes:
        fqn: the borrowing name, ``owner_fqn``: the owning name (both in
            the model that holds the two modules, as messages show them).
    """

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
        """The borrowing module's forward starts: the owner's buffer
        unsharded, its views in both modules (new views node for a
        recorded forward), held until :meth:`post_forward`."""
        if is_held_whole():
            return  # inside full_params: the parameters are whole already
        owner = self.owner
        if owner.collectives is None:
            lazy_init()  # the borrowing module runs before any forward of its root
        owner.tied_holds += 1
        owner.unshard()  # idempotent: a buffer still unsharded is not gathered again
        buffer = self.buffer
        if current_graph_task_id() != -1:  # recomputation inside backward
            buffer.use_unsharded_views()
        elif torch.is_grad_enabled():
            buffer.start_recorded_forward()  # this use's gradient goes through a node of its own
        else:
            buffer.use_unsharded_views()

    def post_forward(self, output: Any, is_held_whole: Callable[[], bool]) -> None:
        """The borrowing module's forward ended: a pre-backward hook on its
        output, and the owner's buffer released (see the module note)."""
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
    """Register ``module.<attr>`` (managed by ``borrower``) as one more slot
    of parameter ``index`` of ``owner``'s ``buffer`` and hook ``module``'s
    forward (see [Note: tied parameters across units]); both units record
    the tie. ``is_held_whole``: whether ``full_params`` holds the owner's
    parameters whole (the hooks then do nothing); ``lazy_init``: the
    borrower's root's lazy init. The pre-hook runs after the module's
    other pre-hooks (a borrowing unit's own makes the root first).

    Pre-condition: the owner's buffer is sharded (at annotation)."""
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
