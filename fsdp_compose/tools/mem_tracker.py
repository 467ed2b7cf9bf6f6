"""torch's ``MemTracker`` on a model annotated with ``fully_shard``.

``torch.distributed._tools.mem_tracker.MemTracker`` installs a gradient hook
and a post-accumulate-grad hook on every parameter of every module the first
time the module runs. Two kinds of parameter refuse them, and the plain
tracker raises on the first module that holds one:

* inside a unit's forward, its modules' parameters are views of the unit's
  flat buffer (see [Note: storage and autograd] in
  ``buffers/flat_buffer.py``), not leaves: torch refuses post-accumulate
  hooks on non-leaf tensors;
* frozen parameters (``requires_grad=False``: a LoRA model's base weights)
  take no gradient hook at all.

:class:`ShardedMemTracker` is ``MemTracker`` that installs those hooks only
on parameters that are leaves and require a gradient (the sharded
parameters outside a unit's forward, the trainable ones); the memory of
every parameter is still counted (the views as parameters: they are the
unit's unsharded storage), and the flat gradient, created by autograd, is
counted when it is created. Everything else (categories, snapshots,
module-wise statistics) is ``MemTracker``'s own; on a model without views or
frozen parameters it behaves exactly as ``MemTracker``.

The figures agree with a direct count (parameters + gradients + optimizer
state after a step) because the library releases unsharded memory in a way
the tracker sees ([Note: staging and memory trackers] in
``buffers/staging.py``); ``tests/tools/test_mem_tracker.py`` checks it.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from .._torch_private import mem_tracker_class, mem_tracker_grad_kind

MemTracker = mem_tracker_class()


class ShardedMemTracker(MemTracker):
    """``MemTracker`` that also runs on ``fully_shard`` models and on models
    with frozen parameters. Use it as the original (``reset_mod_stats()``
    between iterations)::

        tracker = ShardedMemTracker()
        tracker.track_external(model, optim)
        with tracker:
            ...  # training steps
        tracker.get_tracker_snapshot("peak")
    """

    def _track_module_params_and_buffers(self, module: nn.Module,
                                         install_grad_hooks: bool = True) -> tuple[int, int]:
        params = list(module.parameters())
        if all(p.is_leaf and p.requires_grad for p in params):
            return super()._track_module_params_and_buffers(module, install_grad_hooks)
        with warnings.catch_warnings():  # views of a flat buffer: no post-accumulate hook,
            warnings.filterwarnings(     # and their .grad (read by the tracker) is always None
                "ignore", message="The .grad attribute of a Tensor that is not a leaf")
            counted = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in params:
                if param.is_leaf and param.requires_grad:
                    self._hook_gradients(param)
        return counted

    def _hook_gradients(self, param: torch.Tensor) -> None:
        """The two hooks ``MemTracker`` installs on a parameter (once)."""
        if self._param_to_grad_hook_handles.get(param) is not None:
            return  # already hooked: the module ran before, or another module holds it
        kind = mem_tracker_grad_kind()

        def count(grad: torch.Tensor) -> None:  # None: the gradient is not replaced
            self._update_and_maybe_create_winfos(grad, kind)

        self._param_to_grad_hook_handles[param] = (
            param.register_hook(count),
            param.register_post_accumulate_grad_hook(lambda p: count(p.grad)))
