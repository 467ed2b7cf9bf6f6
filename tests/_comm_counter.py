"""Counting c10d collectives independently of the library under test."""

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ALL_GATHER = torch.ops.c10d._allgather_base_.default
REDUCE_SCATTER = torch.ops.c10d._reduce_scatter_base_.default
ALL_REDUCE = torch.ops.c10d.allreduce_.default


class CollectiveCounter(TorchDispatchMode):
    """Counts every c10d op dispatched while active, with the bytes of its
    first (output) tensor argument; also sees ops run inside backward."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()
        self.dtypes: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.counts[func] += 1
            out = args[0]
            if isinstance(out, torch.Tensor):
                self.bytes[func] += out.numel() * out.element_size()
                self.dtypes.setdefault(func, set()).add(out.dtype)
        return func(*args, **(kwargs or {}))
