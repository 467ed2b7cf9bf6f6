"""Counting c10d collectives independently of the library under test."""

from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_compose.comm.wire import set_gloo_reduce_scatter_via_all_reduce

ALL_GATHER = torch.ops.c10d._allgather_base_.default
REDUCE_SCATTER = torch.ops.c10d._reduce_scatter_base_.default
ALL_REDUCE = torch.ops.c10d.allreduce_.default


class CollectiveCounter(TorchDispatchMode):
    """Counts every c10d op dispatched while active, with the bytes of its
    first (output) argument (a tensor, or every tensor of a list: the
    ``allreduce_`` of ``dist.all_reduce`` takes a list); also sees ops run
    inside backward.

    While active, gradient reductions use the portable reduce-scatter op
    (not gloo's all-reduce emulation, see ``_comm.py``), so that counts
    by op describe the library's collective structure on every backend;
    ``gloo_all_reduce=True`` keeps the emulation (to count it)."""

    def __init__(self, gloo_all_reduce: bool = False) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()
        self.dtypes: dict = {}
        self.by_ranks: Counter = Counter()
        """(op, ranks of its process group) -> calls."""
        self.bytes_by_ranks: Counter = Counter()
        self._gloo_all_reduce = gloo_all_reduce
        self._previous = None

    def __enter__(self):
        self._previous = set_gloo_reduce_scatter_via_all_reduce(self._gloo_all_reduce)
        return super().__enter__()

    def __exit__(self, *exc):
        set_gloo_reduce_scatter_via_all_reduce(self._previous)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.counts[func] += 1
            ranks = _group_ranks(args)
            self.by_ranks[func, ranks] += 1
            # the first argument: a tensor, or a list of them (allreduce_, broadcast_)
            for out in _tensors(args[0]):
                self.bytes[func] += out.numel() * out.element_size()
                self.bytes_by_ranks[func, ranks] += out.numel() * out.element_size()
                self.dtypes.setdefault(func, set()).add(out.dtype)
        return func(*args, **(kwargs or {}))


def _tensors(arg) -> list:
    """The tensors of a c10d op's argument, nested lists flattened."""
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for item in arg for t in _tensors(item)]
    return []


def _group_ranks(args) -> tuple:
    """The global ranks of the process group among a c10d op's arguments
    (a TorchScript object; other such arguments, e.g. a ReduceOp, do not
    unbox as a group)."""
    for arg in args:
        if type(arg).__name__ == "ScriptObject":
            try:
                return tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(arg)))
            except RuntimeError:
                continue
    return ()
