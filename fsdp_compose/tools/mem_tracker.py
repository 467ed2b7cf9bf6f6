"""torch's ``MemTracker`` on a model annotated with ``fully_shard``.

``MemTracker`` hooks every parameter of a module the first time it runs,
and raises on a unit's flat-buffer views (not leaves) and on frozen
parameters. :class:`ShardedMemTracker` hooks only leaves that require a
gradient and counts every parameter's memory; the rest is ``MemTracker``'s
([Note: staging and memory trackers]).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from .._torch_private import mem_tracker_class, mem_tracker_grad_kind

MemTracker = mem_tracker_class()


class ShardedMemTracker(MemTracker):
    """``MemTracker`` that also runs on ``fully_shard`` models and on models
    with frozen parameters; use it as the original."""

    def _track_module_params_and_buffers(self, module: nn.Module,
                                         install_grad_hooks: bool = True) -> tuple[int, int]:
        params = list(module.parameters())
        if all(p.is_leaf and p.requires_grad for p in params):
            return super()._track_module_params_and_buffers(module, install_grad_hooks)
        with warnings.catch_warnings():  # flat-buffer views: no post-accumulate hook,
            warnings.filterwarnings(  # and their .grad is always None
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
            return  # already hooked
        kind = mem_tracker_grad_kind()

        def count(grad: torch.Tensor) -> None:
            self._update_and_maybe_create_winfos(grad, kind)

        self._param_to_grad_hook_handles[param] = (
            param.register_hook(count),
            param.register_post_accumulate_grad_hook(lambda p: count(p.grad)))
