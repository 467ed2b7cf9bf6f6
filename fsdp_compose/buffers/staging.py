"""Reusing the memory of unsharded buffers on the CPU.

Freeing a large unsharded buffer and allocating it again for the next unit
makes the CPU allocator return the pages to the kernel and fault them in
again, every unit, every step (tens of thousands of page faults per step).
A :class:`StagingPool` keeps released storages by size and lends them again:
the unsharded buffer's storage object stays the same (autograd's saved views
point at it) and only its data pointer is swapped with a pooled one.

Only used on the CPU: on CUDA the caching allocator already reuses memory,
and it also knows which stream still reads it, which a pool would not.

Lifetime: the pool is emptied at the end of each iteration
(``Scheduler.end_iteration``: after the last backward, or after a forward
that records no graph) unless ``PrefetchPolicy(retain_staging=True)``. Within
an iteration it never holds more than the unsharded working set it has seen
(the in-flight limits bound that), so between steps nothing unsharded is kept;
the price is that the first units of the next forward fault their pages in
again (measured in BENCHMARKS.md, "Performance, round 2").

[Note: staging and memory trackers]
Swapping data pointers is invisible to tools that follow storage sizes
through dispatched ops and ``UntypedStorage.resize_`` (torch's
``MemTracker``): without telling them, a drained storage kept the size it
had when last seen, and ``MemTracker`` counted every unit as unsharded after
the step (the whole model's unsharded bytes too much, issue 22). A drain
therefore ends with ``resize_(0)`` on the storage it emptied (free: it holds
no memory any more), which such tools see; a fill is seen by the next op
that writes the storage (the all-gather). Memory parked in the pool is
free-but-kept to them (like the allocator's cache on CUDA); the pool is
emptied at the end of each iteration.
"""

from __future__ import annotations

import torch


class StagingPool:
    """Released storages, by size in bytes.

    Invariant: every pooled storage holds exactly its key's bytes; a storage
    lent out leaves nothing behind in the pool. The pool holds at most as many
    storages of a size as were unsharded at the same time, so its memory is
    at most the peak of the unsharded working set of the current iteration
    (of every iteration with ``retain_staging``).
    """

    def __init__(self) -> None:
        self._free: dict[int, list[torch.UntypedStorage]] = {}

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory, reused if possible."""
        if storage.nbytes() != 0:
            raise AssertionError(f"staging: storage to fill holds {storage.nbytes()} bytes")
        free = self._free.get(nbytes)
        if free:
            storage._swap_data_ptr_(free.pop())  # the donor shell is left empty and dropped
        else:
            storage.resize_(nbytes)

    def drain(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s memory back into the pool, leaving it empty."""
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        shell = torch.UntypedStorage(0, device=storage.device)
        shell._swap_data_ptr_(storage)
        # see [Note: staging and memory trackers]
        storage.resize_(0)
        self._free.setdefault(nbytes, []).append(shell)

    def clear(self) -> None:
        """Release every pooled storage back to the allocator."""
        self._free.clear()

    @property
    def pooled_bytes(self) -> int:
        return sum(n * len(items) for n, items in self._free.items())
