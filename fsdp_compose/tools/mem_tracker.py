"""torch's ``MemTracker`` on a model annotated with ``fully_shard``.

``torch.distributed._tools.mem_tracker.MemTracker`` installs a gradient hook
and a post-accumulate-grad hook on every parameter of every module the first
time the module runs. Inside a unit's forward, its modules' parameters are
views of the unit's flat buffer (see [Note: storage and autograd] in
``buffers/flat_buffer.py``), not leaves, and torch refuses post-accumulate
hooks on non-leaf tensors, so the plain tracker raises on the first
sub-module of a unit. :class:`ShardedMemTracker` is ``MemTracker`` that
installs those hooks only where every parameter of the module is a leaf (the
sharded parameters, outside a unit's forward); the memory of the views is
still counted (as parameters: they are the unit's unsharded storage), and the
flat gradient, created by autograd, is counted when it is created. Everything
else (categories, snapshots, module-wise statistics) is ``MemTracker``'s own;
on a model without views it behaves exactly as ``MemTracker``.

The figures agree with a direct count (parameters + gradients + optimizer
state after a step) because the library releases unsharded memory in a way
the tracker sees ([Note: staging and memory trackers] in
``buffers/staging.py``); ``tests/test_mem_tracker.py`` checks it.
"""

from __future__ import annotations

import warnings

import torch.nn as nn

from .._torch_private import mem_tracker_class

MemTracker = mem_tracker_class()


class ShardedMemTracker(MemTracker):
    """``MemTracker`` that also runs on ``fully_shard`` models. Use it as
    the original (``reset_mod_stats()`` between iterations)::

        tracker = ShardedMemTracker()
        tracker.track_external(model, optim)
        with tracker:
            ...  # training steps
        tracker.get_tracker_snapshot("peak")
    """

    def _track_module_params_and_buffers(self, module: nn.Module,
                                         install_grad_hooks: bool = True) -> tuple[int, int]:
        if all(p.is_leaf for p in module.parameters()):
            return super()._track_module_params_and_buffers(module, install_grad_hooks)
        with warnings.catch_warnings():  # views of a flat buffer: no post-accumulate hook,
            warnings.filterwarnings(     # and their .grad (read by the tracker) is always None
                "ignore", message="The .grad attribute of a Tensor that is not a leaf")
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)
