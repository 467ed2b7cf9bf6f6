"""One buffer's sharded gradient kept across steps, with the ``.grad``
views made into it once (see [Note: the kept sharded gradient]).

[Note: the kept sharded gradient]
Making the ``.grad`` views and a new sharded gradient at every step is host
time the unsharded model does not pay, so the last sharded gradient and its
views are kept, and the next reduction writes into it where nobody else can
see it:

* *free*: nothing but the library holds the views or their memory.
  :meth:`KeptGradient.holders` counts Python references to a view
  (``sys.getrefcount``), C++ references (``Tensor._use_count``: a
  ``.grad``, an autograd graph, a DLPack capsule) and other tensors on the
  memory (the storage's use count: ``p.grad.detach()``, a slice, a NumPy
  array); it is at its baseline exactly when the gradient is free (a
  holder of ``p.grad._base`` is not counted).
* *in use*: a ``.grad`` still views it (``zero_grad(set_to_none=False)``)
  or the user holds a piece. The next reduction adds to it, or, where every
  ``.grad`` was cleared, writes into a new gradient and leaves the old one
  to its holders.
* *released*: free after ``zero_grad`` or at the root's next pre-forward,
  its storage is resized to 0 bytes (the views stay). The next reduction
  resizes it and the reduce-scatter writes every element; over one rank it
  takes the memory of autograd's flat gradient instead
  (:meth:`KeptGradient.take_memory_of`; a copy where torch cannot swap).
  So between steps it holds what a new gradient per step would.

Only where torch counts uses (``_torch_private.CAN_COUNT_USES``) and not in
pinned memory (CPU offload makes a new gradient per step).
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

import torch

from .._torch_private import (CAN_SWAP_STORAGE_DATA, storage_key, storage_key_use_count,
                              storage_use_count, swap_storage_data, tensor_use_count)


class KeptGradient:
    """A sharded gradient (``base``, ``S`` elements) and the ``.grad`` view
    of each parameter (``views``, by parameter index), made once.

    Invariant: ``baseline`` is :meth:`holders` with nothing but this object
    referencing ``views`` and ``storage``; while ``released``, the storage
    holds 0 bytes and the gradient is free."""

    __slots__ = ("base", "views", "storage", "key", "nbytes", "baseline", "released")

    def __init__(self, base: torch.Tensor,
                 make_views: Callable[[torch.Tensor], Sequence[torch.Tensor]]) -> None:
        self.base: torch.Tensor = base
        self.views: tuple[torch.Tensor, ...] = tuple(make_views(base))  # no other holder
        self.storage: torch.UntypedStorage = base.untyped_storage()
        self.key: int = storage_key(self.storage)
        self.nbytes: int = self.storage.nbytes()
        self.released: bool = False
        self.baseline: int = 0
        self.baseline = self.holders()

    def holders(self) -> int:
        """Every reference to the views and their memory, summed (see the
        Note): any holder besides this object raises it above ``baseline``."""
        views = self.views
        return (storage_key_use_count(self.key) + sum(map(tensor_use_count, views))
                + sum(map(sys.getrefcount, views)))

    @property
    def is_free(self) -> bool:
        """Nothing outside the library references the gradient."""
        return self.released or self.holders() == self.baseline

    def release(self) -> None:
        """Give the memory back. Pre-condition: :attr:`is_free`."""
        self.storage.resize_(0)
        self.released = True

    def take_memory_of(self, tensor: torch.Tensor) -> bool:
        """Make ``tensor``'s memory the base's, without a copy, where
        ``tensor`` is all of a storage of the base's size that nothing else
        views (over one rank: the flat gradient autograd made, about to be
        dropped); ``tensor`` is left holding the base's old memory (none
        once released). Returns whether it did. Pre-condition: free, and
        ``tensor`` in the base's dtype and on its device."""
        if not CAN_SWAP_STORAGE_DATA or tensor.storage_offset():
            return False
        storage = tensor.untyped_storage()
        if storage.nbytes() != self.nbytes or storage_use_count(storage) != 2:
            return False  # 2: the tensor and the storage object just made
        swap_storage_data(self.storage, storage)
        self.released = False
        return True

    def reclaim(self) -> torch.Tensor:
        """The base, its memory back (uninitialised where it was released),
        for a reduction to write every element of. Pre-condition:
        :attr:`is_free`."""
        if self.released:
            self.storage.resize_(self.nbytes)
            self.released = False
        return self.base
