"""One buffer's sharded gradient kept across steps, with the ``.grad`` views made into it once.

[Note: the kept sharded gradient]
Making the ``.grad`` views and a new sharded gradient every step is host time the unsharded
model does not pay, so they are kept and the next reduction writes into them while nothing
outside the library holds them (:meth:`KeptGradient.holders` at its baseline). A gradient the
user still holds is added to, or left to its holders; a free one is *released* to 0 bytes
after ``zero_grad`` or at the root's pre-forward. Only where torch counts uses
(``CAN_COUNT_USES``) and not in pinned memory.
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

import torch

from .._torch_private import (CAN_SWAP_STORAGE_DATA, storage_key, storage_key_use_count,
                              storage_use_count, swap_storage_data, tensor_use_count)


class KeptGradient:
    """A sharded gradient ``base`` and its ``.grad`` views. Invariant: ``baseline`` is
    :meth:`holders` with nothing else holding them; while ``released`` the storage holds 0
    bytes."""

    __slots__ = ("base", "views", "storage", "key", "nbytes", "baseline", "released")

    def __init__(self, base: torch.Tensor,
                 make_views: Callable[[torch.Tensor], Sequence[torch.Tensor]]) -> None:
        self.base: torch.Tensor = base
        self.views: tuple[torch.Tensor, ...] = tuple(make_views(base))
        self.storage: torch.UntypedStorage = base.untyped_storage()
        self.key: int = storage_key(self.storage)
        self.nbytes: int = self.storage.nbytes()
        self.released: bool = False
        self.baseline: int = 0
        self.baseline = self.holders()

    def holders(self) -> int:
        """Every reference to the views and their memory, summed; any holder outside raises it
        above ``baseline``."""
        views = self.views
        return (storage_key_use_count(self.key) + sum(map(tensor_use_count, views))
                + sum(map(sys.getrefcount, views)))

    @property
    def is_free(self) -> bool:
        return self.released or self.holders() == self.baseline

    def release(self) -> None:
        """Pre-condition: :attr:`is_free`."""
        self.storage.resize_(0)
        self.released = True

    def take_memory_of(self, tensor: torch.Tensor) -> bool:
        """Make ``tensor``'s memory the base's without a copy where ``tensor`` is all of a
        storage of its size nothing else views; returns whether it did. Pre-condition: free."""
        if not CAN_SWAP_STORAGE_DATA or tensor.storage_offset():
            return False
        storage = tensor.untyped_storage()
        if storage.nbytes() != self.nbytes or storage_use_count(storage) != 2:
            return False  # the tensor and the storage object just made
        swap_storage_data(self.storage, storage)
        self.released = False
        return True

    def reclaim(self) -> torch.Tensor:
        """The base, its memory back, for a reduction to overwrite. Pre-condition:
        :attr:`is_free`."""
        if self.released:
            self.storage.resize_(self.nbytes)
            self.released = False
        return self.base
