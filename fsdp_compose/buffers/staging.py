"""Reusing the memory of unsharded buffers on the CPU: freeing a large buffer and allocating it
again makes the allocator return its pages to the kernel and fault them in again, every unit
and step. A :class:`StagingPool` keeps released memory by size and lends it again by swapping
the storage's data pointer (autograd's saved views stay valid); emptied at the end of each
iteration unless ``retain_staging``.

[Note: releasing what no fill will take]
Each iteration is expected to fill each size as often as the most of the last :data:`HISTORY`;
once it did, that size's pooled memory is freed, so nothing waits through the step's peak. A
wrong guess costs speed, never values.

[Note: the pool across the end of forward]
The end of the root's forward, where activations peak, frees the pool (not under
``retain_staging``).

[Note: staging and memory trackers]
Memory trackers do not see pointer swaps, so a drain ends with ``resize_(0)`` and pooled
memory is held in ``uint8`` tensors made by dispatched ops.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Optional

import torch

from .._torch_private import CAN_SWAP_STORAGE_DATA, swap_storage_data

HISTORY = 4


class StagingPool:
    """Released storages by size. Invariant: each pooled storage holds exactly its key's bytes,
    and the pool at most the iteration's peak unsharded working set."""

    def __init__(self) -> None:
        self.enabled: bool = CAN_SWAP_STORAGE_DATA
        self._free: dict[int, list[torch.Tensor]] = {}
        """Size in bytes -> pooled ``uint8`` tensors ([Note: staging and memory trackers])."""
        self._fills: Counter[int] = Counter()
        self._history: deque[Counter[int]] = deque(maxlen=HISTORY)
        self._expected: Optional[Counter[int]] = None
        self._first_iteration: bool = True

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        if storage.nbytes() != 0:
            raise AssertionError(f"staging: storage to fill holds {storage.nbytes()} bytes")
        if not self.enabled:
            storage.resize_(nbytes)
            return
        free = self._free.get(nbytes)
        if free:
            swap_storage_data(storage, free.pop().untyped_storage())
        else:
            storage.resize_(nbytes)
        self._fills[nbytes] += 1
        if not self._wanted(nbytes):
            self._free.pop(nbytes, None)  # the iteration's last fill of this size

    def drain(self, storage: torch.UntypedStorage) -> None:
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        if not self.enabled or not self._wanted(nbytes):
            storage.resize_(0)  # no fill will take it this iteration
            return
        shell = torch.UntypedStorage(0, device=storage.device)
        swap_storage_data(shell, storage)
        storage.resize_(0)
        kept = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(shell)
        self._free.setdefault(nbytes, []).append(kept)

    def _wanted(self, nbytes: int) -> bool:
        if self._expected is None:  # no history: none in the first iteration, all after
            return not self._first_iteration
        return self._fills[nbytes] < self._expected[nbytes]

    def release(self) -> None:
        self._free.clear()

    def keep(self) -> None:
        """End of an iteration under ``retain_staging``: keep what is pooled."""
        self._first_iteration = False

    def clear(self) -> None:
        """End of an iteration: free the pool and remember each size's fills."""
        self._first_iteration = False
        self._free.clear()
        if self._fills:
            self._history.append(self._fills)
            self._expected = Counter()
            for counts in self._history:
                self._expected |= counts
        self._fills = Counter()

    @property
    def pooled_bytes(self) -> int:
        return sum(n * len(items) for n, items in self._free.items())
