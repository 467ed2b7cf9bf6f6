"""Saved activations and forward order of one batch, measured on fake
tensors (``FakeTensorMode``: no memory, no process group)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from ..._torch_private import TorchDispatchMode, fake_tensor_mode, local_scalar_dense_op, storage_key

BatchFn = Callable[[nn.Module], Any]


class _ScalarReads(TorchDispatchMode):
    """``.item()`` of a fake tensor reads 1 (models branch on values)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is local_scalar_dense_op():
            t = args[0]
            return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1
        return func(*args, **(kwargs or {}))


def fake_forward(model: nn.Module, unit_modules: list[tuple[nn.Module, ...]],
                  batch_fn: BatchFn) -> tuple[list[int], list[int], list[int]]:
    """Run ``batch_fn(model)`` on fake CPU parameters and buffers. Returns the
    units' first-forward order, the bytes saved while each unit was the
    innermost running, and the root's by position."""
    owner = {id(m): i for i, modules in enumerate(unit_modules) for m in modules}
    running: list[int] = []
    order: list[int] = []
    unit_acts = [0] * (len(unit_modules) + 1)
    root_acts = [0] * (len(unit_modules) + 1)
    saved: dict[int, torch.Tensor] = {}  # storage -> a tensor on it (keeps the key unique)

    def pre(module, args):
        running.append(owner[id(module)])
        if running[-1] not in order:
            order.append(running[-1])

    def post(module, args, output):
        running.pop()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t.untyped_storage())
        if key not in saved and key not in weights:
            saved[key] = t
            nbytes = t.untyped_storage().nbytes()
            if running:
                unit_acts[running[-1]] += nbytes
            else:
                root_acts[len(order)] += nbytes
        return t

    mode = fake_tensor_mode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}
    slots = [(table, name, t) for m in model.modules() for table in (m._parameters, m._buffers)
             for name, t in table.items() if t is not None]
    with mode:
        for _, _, t in slots:
            if id(t) not in fakes:
                fakes[id(t)] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                   device="cpu").requires_grad_(t.requires_grad)
    weights = {storage_key(fakes[id(p)].untyped_storage()) for p in model.parameters()}
    handles = [h for modules in unit_modules for m in modules
               for h in (m.register_forward_pre_hook(pre),
                         m.register_forward_hook(post, always_call=True))]
    try:
        for table, name, t in slots:
            table[name] = fakes[id(t)]
        with mode, _ScalarReads(), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            batch_fn(model)
    finally:
        for table, name, t in slots:
            table[name] = t
        for h in handles:
            h.remove()
    return order, unit_acts, root_acts
