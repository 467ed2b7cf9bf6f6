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
(``CollectiveQueue.end_iteration``: after the last backward, or after a forward
that records no graph) unless ``PrefetchPolicy(retain_staging=True)``. Within
an iteration it never holds more than the unsharded working set it has seen
(the in-flight limits bound that), so between steps nothing unsharded is kept;
the price is that the first units of the next forward fault their pages in
again.

[Note: releasing what no fill will take]
Memory released after the iteration's last fill of its size would only wait
in the pool for the end of the iteration; on the benchmark GPT that is two
blocks' unsharded buffers (24 MiB) kept through the embedding's backward,
where the step's peak is. The pool therefore counts the fills of each size
per iteration (between two :meth:`StagingPool.clear`) and expects the next
iteration to fill each size as often as the most of its recent iterations
did (:data:`HISTORY`; train and eval steps may alternate). Once an
iteration made that many fills of a size, its pooled memory of that size is
freed and later releases of that size go straight back to the allocator.
A wrong guess only costs speed, never values: an unexpected extra fill
allocates (faults its pages in) as without a pool. The first iteration has
no history: nothing is pooled in it (its pages are faulted in as without a
pool), so its peak is never above what freeing gives. Under
``retain_staging``, which never clears, everything is pooled from the
second iteration on. In the steady state nothing is faulted in more than
before: what is freed early would have been freed at the end of the
iteration.

[Note: the pool across the end of forward]
When the root's forward ends, the pool holds the last units' unsharded
memory for the first fills of backward. That moment (the loss, then the
start of backward) is where a step's activations peak, and memory freed
instead would not count there: on the step-memory benchmark's GPT the
pool held two blocks' buffers (24 MiB) at the forward and backward peaks of
every step, above FSDP2's. So the end of the root's forward frees the pool
(``CollectiveQueue.end_forward``; not under ``retain_staging``): the
backward's first fills fault their pages in again, once per step.

[Note: staging and memory trackers]
Swapping data pointers is invisible to tools that follow storage sizes
through dispatched ops and ``UntypedStorage.resize_`` (torch's
``MemTracker``). Two things keep their count equal to the allocator's:

* a drain ends with ``resize_(0)`` on the storage it emptied (free: it holds
  no memory any more), which such tools see. Without it a drained storage
  kept the size it had when last seen, and ``MemTracker`` counted every unit
  as unsharded after the step (the whole model's unsharded bytes too much);
* the pool keeps each released block of memory in a ``uint8`` tensor made by
  dispatched ops (``empty`` + ``set_`` onto the storage that took the
  memory), so such tools see it appear with its size and disappear when the
  pool lends or frees it. When pooled memory was kept in a bare storage,
  ``MemTracker``'s peak missed it: on the benchmark GPT the peak is the
  embedding's backward at the end of backward, while the pool still holds
  two blocks' unsharded buffers (24 MiB, 5% of the peak).

A fill is seen by the next op that writes the storage (the all-gather).
Tools that attribute memory by category see pooled memory in the category
of the moment it was released (temporaries in backward, activations in
forward). The two extra ops per release cost a few microseconds, nothing
next to the unit's collectives; no tool attached, they are plain calls.

[Note: torch without _swap_data_ptr_]
Lending memory to a storage object that views already point at needs
``UntypedStorage._swap_data_ptr_`` (torch>=2.12; ``_torch_private.py``).
torch 2.11's storages offer no other way to give a storage object another
block of memory that we found: ``resize_`` allocates a new one,
``Tensor.set_`` changes the tensor and not the storage autograd's saved
views hold, ``_set_cdata`` changes which storage the Python object wraps. Where it is missing the pool
is off (``StagingPool.enabled`` is ``False``): a fill allocates with
``resize_(nbytes)`` and a drain frees with ``resize_(0)``, exactly what
buffers off the CPU do. Values and memory are as with the pool or lower (no
pooled memory); the cost is the page faults the pool avoids.
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
        """Whether memory is pooled at all: not on a torch without
        ``_swap_data_ptr_`` (see [Note: torch without _swap_data_ptr_]);
        tests turn it off to run that path on any torch."""
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
        """Nothing is pooled before the first iteration ends: with no
        history the pool cannot tell which release a later fill will take,
        and memory kept for nothing would raise the first step's peak above
        what freeing gives (one block of the benchmark GPT, 12 MiB)."""

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
