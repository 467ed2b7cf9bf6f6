"""Reusing the memory of unsharded buffers on the CPU.

Freeing a large unsharded buffer and allocating it again for the next unit
makes the CPU allocator return its pages to the kernel and fault them in
again, every unit and step. A :class:`StagingPool` keeps released memory by
size and lends it again: the unsharded storage object stays the same
(autograd's saved views point at it); only its data pointer is swapped. CPU
only: CUDA's caching allocator reuses memory and knows which stream reads it.
The pool is emptied at the end of each iteration
(``CollectiveQueue.end_iteration``) unless ``PrefetchPolicy(retain_staging=True)``.

[Note: releasing what no fill will take]
Memory released after the iteration's last fill of its size would only wait
in the pool through the step's peak. The pool counts each size's fills per
iteration and expects the next to fill each size as often as the most of
the last :data:`HISTORY` iterations (train and eval steps may alternate);
once an iteration made that many fills of a size, its pooled memory is
freed and later releases go straight to the allocator. A wrong guess costs
speed, never values. The first iteration has no history and pools nothing;
under ``retain_staging`` everything is pooled from the second on.

[Note: the pool across the end of forward]
The end of the root's forward, where activations peak, frees the pool
(``CollectiveQueue.end_forward``; not under ``retain_staging``) so that
memory held for backward's first fills does not count at the peak.

[Note: staging and memory trackers]
Swapping data pointers is invisible to tools that follow storage sizes
through dispatched ops and ``resize_`` (torch's ``MemTracker``). To keep
their count equal to the allocator's, a drain ends with ``resize_(0)`` on
the storage it emptied, and pooled memory is held in a ``uint8`` tensor
made by dispatched ops (``empty`` + ``set_``), so they see it appear and
disappear. A fill is seen by the next op that writes the storage (the
all-gather).

[Note: torch without _swap_data_ptr_]
Lending memory to a storage object that views point at needs
``UntypedStorage._swap_data_ptr_`` (``resize_`` allocates anew,
``Tensor.set_`` changes the tensor, not the storage). Without it the pool
is off (``StagingPool.enabled`` false): a fill is ``resize_(nbytes)``, a
drain ``resize_(0)``.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Optional

import torch

from .._torch_private import CAN_SWAP_STORAGE_DATA, swap_storage_data

HISTORY = 4
"""Iterations whose fill counts :class:`StagingPool` remembers."""


class StagingPool:
    """Released storages, by size in bytes.

    Invariant: every pooled tensor's storage holds exactly its key's bytes;
    memory lent out leaves nothing behind in the pool. The pool holds at
    most as many storages of a size as were unsharded at the same time, so
    its memory is at most the peak of the unsharded working set of the
    current iteration (of every iteration with ``retain_staging``), and none
    of a size after the iteration's expected last fill of that size.
    """

    def __init__(self) -> None:
        self.enabled: bool = CAN_SWAP_STORAGE_DATA
        """Memory is pooled at all ([Note: torch without _swap_data_ptr_])."""
        self._free: dict[int, list[torch.Tensor]] = {}
        """Size in bytes -> pooled memory, each in a ``uint8`` tensor of that
        many elements (see [Note: staging and memory trackers])."""
        self._fills: Counter[int] = Counter()
        """Fills of each size in the current iteration."""
        self._history: deque[Counter[int]] = deque(maxlen=HISTORY)
        """Fills of each size in the last iterations (oldest first)."""
        self._expected: Optional[Counter[int]] = None
        """Fills of each size expected per iteration: the most over
        ``_history`` (``None``: no history); see [Note: releasing what no
        fill will take]."""
        self._first_iteration: bool = True
        """Nothing is pooled before the first iteration ends (no history: see
        [Note: releasing what no fill will take])."""

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory, reused if possible."""
        if storage.nbytes() != 0:
            raise AssertionError(f"staging: storage to fill holds {storage.nbytes()} bytes")
        if not self.enabled:
            storage.resize_(nbytes)
            return
        free = self._free.get(nbytes)
        if free:
            # the donor is left empty and dropped (trackers see its storage die)
            swap_storage_data(storage, free.pop().untyped_storage())
        else:
            storage.resize_(nbytes)
        self._fills[nbytes] += 1
        if not self._wanted(nbytes):
            self._free.pop(nbytes, None)  # the iteration's last fill of this size

    def drain(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s memory back into the pool, leaving it empty."""
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        if not self.enabled or not self._wanted(nbytes):
            storage.resize_(0)  # no fill will take it this iteration: free it now
            return
        shell = torch.UntypedStorage(0, device=storage.device)
        swap_storage_data(shell, storage)
        # see [Note: staging and memory trackers]
        storage.resize_(0)
        kept = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(shell)
        self._free.setdefault(nbytes, []).append(kept)

    def _wanted(self, nbytes: int) -> bool:
        """Whether a fill of ``nbytes`` is still expected this iteration."""
        if self._expected is None:  # no history: none in the first iteration, all after
            return not self._first_iteration
        return self._fills[nbytes] < self._expected[nbytes]

    def release(self) -> None:
        """Free every pooled storage now; the iteration goes on (its fill
        counts are kept)."""
        self._free.clear()

    def keep(self) -> None:
        """End of an iteration under ``retain_staging``: keep what is
        pooled, and from now on pool every release."""
        self._first_iteration = False

    def clear(self) -> None:
        """End of an iteration: release every pooled storage back to the
        allocator and remember how often each size was filled."""
        self._first_iteration = False
        self._free.clear()
        if self._fills:
            self._history.append(self._fills)
            self._expected = Counter()
            for counts in self._history:
                self._expected |= counts  # the most per size
        self._fills = Counter()

    @property
    def pooled_bytes(self) -> int:
        return sum(n * len(items) for n, items in self._free.items())
